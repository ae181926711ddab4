"""What one engine step computes: the contract between the scheduler (rank 0) and every runner.

Rank 0 builds a StepPlan and broadcasts it to the other ranks of the engine group; all ranks run
the same forward on their weight shards. Only ints cross this boundary, so it pickles small and the
scheduler stays free of tensors.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SeqChunk:
    seq_id: int
    token_ids: tuple[int, ...]  # tokens whose KV this step computes (a prefill chunk, or 1 to decode)
    start_pos: int  # position of token_ids[0]; KV for [0, start_pos) is already in the pages
    page_table: tuple[int, ...]  # pages covering at least start_pos + len(token_ids) tokens
    sample: bool  # True when this chunk ends at the sequence's newest token: sample the next one

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    model: str
    chunks: tuple[SeqChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(frozen=True, slots=True)
class StopPlan:
    """Broadcast by rank 0 to end the worker loops cleanly."""
