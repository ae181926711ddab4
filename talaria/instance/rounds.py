"""The records of a cold-pool round: its configuration, rounds, slots and phases, and the decisions
the round scheduler returns (paper §3.4, Fig. 4). Bookkeeping only; the policy is in
`talaria/instance/round_scheduler.py`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

from talaria.config.schema import (
    Ablation,
    InstanceConfig,
    SlotLength,
    SlotOrder,
    SpBatch,
)
from talaria.contracts.step_plan import SeqChunk
from talaria.contracts.vocabulary import SwitchPath


class Phase(str, Enum):
    P = "P"  # queued prefill admitted when the slot opened
    D1 = "D1"  # decode before the first SP opportunity is taken
    SP = "SP"  # session-prefill: continuations admitted mid-slot
    D = "D"  # decode after an SP step
    DFIN = "Dfin"  # decode once the budget after protected decode is spent


DECODE_PHASES = (Phase.D1, Phase.D, Phase.DFIN)


@dataclass(frozen=True, slots=True)
class RoundConfig:
    ttft_s: float  # TTFT target; rounds are bounded by gamma * ttft_s
    tpot_s: float  # average time-per-output-token target (decode share)
    gamma: float  # < 1
    sp: bool = True  # session-prefill on (the "sp" ablation turns it off)
    order: SlotOrder = SlotOrder.ROUND_ROBIN
    length: SlotLength = SlotLength.DEMAND
    max_batch_tokens: int = 512  # tokens per engine step
    min_chunk_tokens: int = 0  # smallest P/SP chunk worth a step; 0 = max(page, max_batch_tokens / 4)
    # thrash guard: a slot that needs a switch must be predicted to serve at least thrash_k x its
    # opening (the switch and its P's first fixed cost), else the model is deferred to a later round --
    # but never more than max_deferrals rounds in a row (its next slot then gets at least that much
    # budget, bound or not)
    thrash_k: float = 1.0
    max_deferrals: int = 2
    sp_batch: SpBatch = SpBatch.PAPER  # which continuations an SP step admits (sp_batch.py)

    @property
    def round_s(self) -> float:
        return self.gamma * self.ttft_s

    @classmethod
    def of(cls, instance: InstanceConfig) -> RoundConfig:
        """The round configuration an instance's config asks for."""
        return cls(instance.ttft_s, instance.tpot_s, instance.gamma, instance.enabled(Ablation.SP),
                   instance.slot_order, instance.slot_length, instance.max_batch_tokens,
                   sp_batch=instance.sp_batch)


@dataclass(frozen=True, slots=True)
class Step:
    """Run these chunks of the active model as one engine step of `phase`."""

    phase: Phase
    chunks: tuple[SeqChunk, ...]
    predicted_s: float


@dataclass(frozen=True, slots=True)
class Switch:
    """Open `model` before its slot starts."""

    model: str
    path: SwitchPath  # the load path expected
    predicted_s: float


@dataclass(slots=True)
class Slot:
    model: str
    budget_s: float  # L_m, predicted seconds
    protected: int  # d_m: decode iterations reserved before P and SP get budget
    start: float | None = None  # when P began (after the switch, if any)
    p_set: set[int] = field(default_factory=set)  # sequences queued when P began: only P admits them
    sp_set: set[int] = field(default_factory=set)  # sequences admitted by SP in this slot
    parked: set[int] = field(default_factory=set)  # continuations that got a park event in this slot
    phase: Phase = Phase.P
    last: Phase | None = None  # the phase of the last step
    steps: int = 0
    decode_steps: int = 0
    opportunities: int = 0  # SP steps taken
    short: bool = False  # P ended with queued work left (counted once per slot)
    seg_start: float = 0.0  # the current phase segment: first step's time, steps, tokens
    seg_steps: int = 0
    seg_tokens: int = 0

    def telemetry(self, now: float) -> dict:
        return {"model": self.model, "phase": self.phase.value, "budget_s": self.budget_s,
                "elapsed_s": now - self.start if self.start is not None else 0.0, "protected": self.protected,
                "decode_steps": self.decode_steps, "sp_opportunities": self.opportunities}


@dataclass(slots=True)
class Round:
    number: int
    start: float
    queue: list[str]  # models whose slot is still to come, next first
    budgets: dict[str, float]
    protected: dict[str, int]
    deferred: list[str] = field(default_factory=list)  # models with work left out by the thrash guard
    time: Counter = field(default_factory=Counter)  # seconds by "P", "D", "SP", "switch"
    sp_admitted: int = 0
    sp_parked: int = 0
    slots: list[dict] = field(default_factory=list)

    def summary(self, now: float) -> dict:
        """The `round` event's data (docs/events.md): wall_s = active_s + switch_s."""
        wall = now - self.start
        return {"round": self.number, "start": self.start, "wall_s": wall, "active_s": wall - self.time["switch"],
                "switch_s": float(self.time["switch"]), "p_s": float(self.time["P"]), "d_s": float(self.time["D"]),
                "sp_s": float(self.time["SP"]), "sp_admitted": self.sp_admitted, "sp_parked": self.sp_parked,
                "slots": self.slots, "deferred": self.deferred}
