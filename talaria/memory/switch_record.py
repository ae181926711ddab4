"""What one model switch cost, per TP rank and as a logical switch (paper Appendix D).

Each rank records one `RankSwitchRecord` per switch, with its time in each of the five ordered
phases, the load path its gather plan took and the staged / dirty byte counts. A logical switch
is done only when its slowest rank is, so `SwitchRecord.total_ms` is the maximum over ranks of each
rank's phase sum, and its path is the worst rank's path.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from talaria.contracts.vocabulary import SwitchPath


class SwitchPhase(Enum):
    """The five phases of a switch, in the order they run."""

    SAVE_TEARDOWN = "save_teardown"  # drain outgoing D2H, save KV/graph handles, release runtime buffers
    OPEN_WEIGHTS = "open_weights"  # wait for staging, then D2D gather / H2D top-up / full H2D
    KV_SHELL = "kv_shell"  # rebind the cached KV-pool shell, or rebuild it
    RUNTIME = "runtime"  # restore cached attention backend and graphs, or rebuild them
    PUBLISH = "publish"  # hand the new model, allocator, KV and radix references to the scheduler


PHASES = tuple(SwitchPhase)


@dataclass(frozen=True, slots=True)
class RankSwitchRecord:
    """One rank's view of one switch."""

    rank: int
    from_model: str | None  # None for the first open on this rank
    to_model: str
    path: SwitchPath
    phase_ms: tuple[float, float, float, float, float]  # in SwitchPhase order
    staged_bytes: int  # weight bytes gathered D2D
    dirty_bytes: int  # bytes staged but overwritten by KV, reloaded from host
    total_bytes: int  # the target's weight image on this rank
    rebuilt_runtime: bool  # the pointer check failed: KV shell / graphs were rebuilt, not reused

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase_ms", tuple(float(ms) for ms in self.phase_ms))  # lists welcome
        if len(self.phase_ms) != len(PHASES):
            raise ValueError(f"rank {self.rank}: phase_ms has {len(self.phase_ms)} values, "
                             f"need {len(PHASES)} ({', '.join(p.value for p in PHASES)})")
        if any(ms < 0 for ms in self.phase_ms):
            raise ValueError(f"rank {self.rank}: negative phase time in {self.phase_ms}")

    @property
    def total_ms(self) -> float:
        return sum(self.phase_ms)

    def phase(self, phase: SwitchPhase) -> float:
        """Milliseconds spent in `phase`."""
        return self.phase_ms[PHASES.index(phase)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "from_model": self.from_model,
            "to_model": self.to_model,
            "path": self.path.value,
            "phase_ms": {p.value: ms for p, ms in zip(PHASES, self.phase_ms)},
            "total_ms": self.total_ms,
            "staged_bytes": self.staged_bytes,
            "dirty_bytes": self.dirty_bytes,
            "total_bytes": self.total_bytes,
            "rebuilt_runtime": self.rebuilt_runtime,
        }


@dataclass(frozen=True, slots=True)
class SwitchRecord:
    """One logical switch: the records of every TP rank, which must agree on the models."""

    ranks: tuple[RankSwitchRecord, ...]

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("a switch record needs at least one rank record")
        models = {(r.from_model, r.to_model) for r in self.ranks}
        if len(models) != 1:
            raise ValueError(f"rank records disagree on the switch: {sorted(models, key=str)}")

    @property
    def from_model(self) -> str | None:
        return self.ranks[0].from_model

    @property
    def to_model(self) -> str:
        return self.ranks[0].to_model

    @property
    def total_ms(self) -> float:
        """The slowest rank's phase sum: a logical switch ends when its last rank does."""
        return max(r.total_ms for r in self.ranks)

    @property
    def path(self) -> SwitchPath:
        """The worst path over ranks (H2D_ONLY > PARTIAL > FULL_D2D)."""
        return max((r.path for r in self.ranks), key=lambda p: p.severity)

    @property
    def rebuilt_runtime(self) -> bool:
        return any(r.rebuilt_runtime for r in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the logical summary plus every rank's record."""
        return {
            "from_model": self.from_model,
            "to_model": self.to_model,
            "path": self.path.value,
            "total_ms": self.total_ms,
            "rebuilt_runtime": self.rebuilt_runtime,
            "ranks": [r.to_dict() for r in self.ranks],
        }
