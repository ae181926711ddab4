"""A call's life on an instance: token ids, KV progress and status, in plain Python.

The scheduler owns sequences; the runner only ever sees the StepPlan built from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from talaria.contracts.call import FinishReason, InstanceCall, SamplingParams


class SeqStatus(Enum):
    WAITING = "waiting"  # queued, holds no KV pages
    RUNNING = "running"  # holds KV pages; prefilling in chunks or decoding
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    seq_id: int
    call: InstanceCall
    token_ids: list[int]  # prompt followed by every generated token
    arrival: float  # instance clock when the call arrived
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose KV is in the page table
    page_table: list[int] = field(default_factory=list)
    state_slot: int = -1  # its live per-sequence state slot while running (stateful layouts only)
    num_cached: int = 0  # prompt tokens served from the prefix cache (first admission only)
    num_restored: int = 0  # of those, restored from the host KV registry
    num_emitted: int = 0  # generated tokens already sent to the gateway
    finish: FinishReason | None = None
    first_scheduled: float | None = None
    prefill_s: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None
    admitted_once: bool = False
    page_hashes: tuple[int, ...] = ()  # cumulative hashes of its computed full pages, set when it leaves
    root: int = 0  # where its page-hash chain starts: chain_root(call.cache_salt)
    computed_high: int = 0  # the most tokens it has ever had KV for (set when it is preempted)
    lost_tokens: int = 0  # KV of whole pages it had computed and lost (preempted, not kept): recomputed

    @property
    def model(self) -> str:
        return self.call.model

    @property
    def sampling(self) -> SamplingParams:
        return self.call.sampling

    @property
    def num_prompt(self) -> int:
        return len(self.call.prompt_token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        """True until every token but the newest one has KV (decode computes one token a step)."""
        return self.num_uncomputed > 1
