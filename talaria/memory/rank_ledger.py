"""What one tensor-parallel rank has written into its KV, per sequence, for the HKVR agreement.

Every rank records the tokens of each chunk it computes, so when a prefix is checkpointed to host
memory each rank can report, from its own history, how many tokens it committed and the cumulative
page hashes of them (paper App. B, "Prefix agreement"). Only the prefix on which all ranks agree is
published; a lagging or diverging rank costs reuse, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass

from talaria.memory.host_kv_registry import RankReport
from talaria.memory.page_manager import PageManager


@dataclass(frozen=True, slots=True)
class TestOnlyFault:
    """A fault injected into one rank's reports by tests (it cannot be caused for real here)."""

    rank: int
    shorten_tokens: int = 0  # report this many fewer committed tokens
    corrupt_page: int | None = None  # report a different hash from this page on


class RankLedger:
    def __init__(self, rank: int, page_size: int, fault: TestOnlyFault | None = None) -> None:
        self.rank = rank
        self._pages = PageManager(0, page_size)  # only for its hash chain arithmetic
        self._tokens: dict[int, list[int]] = {}
        self._roots: dict[int, int] = {}
        self._fault = fault if fault is not None and fault.rank == rank else None

    def record(self, seq_id: int, start_pos: int, token_ids: tuple[int, ...], prefix: tuple[int, ...] = (),
               root: int = 0) -> None:
        """This rank wrote KV for token_ids at positions start_pos.. (a recompute rewrites them);
        `prefix`, on admission, is what it reused for [0, start_pos) from its cache or host slabs;
        `root`: where the sequence's page-hash chain starts."""
        self._roots[seq_id] = root
        tokens = self._tokens.setdefault(seq_id, [])
        if prefix:
            tokens[:] = prefix
        del tokens[start_pos:]
        tokens.extend(token_ids)

    def report(self, seq_id: int) -> RankReport:
        tokens = self._tokens.get(seq_id, [])
        committed = len(tokens)
        chain = self._pages.extend_chain([], tokens, self._roots.get(seq_id, 0))
        if self._fault is not None:
            committed = max(0, committed - self._fault.shorten_tokens)
            if self._fault.corrupt_page is not None and self._fault.corrupt_page < len(chain):
                chain[self._fault.corrupt_page] ^= 1
        return RankReport(committed, tuple(chain))

    def forget(self, seq_id: int) -> None:
        self._tokens.pop(seq_id, None)
        self._roots.pop(seq_id, None)
