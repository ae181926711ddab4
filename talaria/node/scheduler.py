"""The instance scheduler on rank 0: calls in, one StepPlan per step, CallOutputs back.

It owns a Batcher per model the instance serves and decides which model steps next: round-robin
over models with work, so every model progresses. (The cold-pool round scheduler with
session-prefill replaces this choice with slots and rounds; hot instances keep it.)
Time comes from an injected clock so tests and the simulator drive it deterministically.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import count

from talaria.contracts.call import CallOutput, CallTimings, FinishReason, InstanceCall, InstanceStats, Usage
from talaria.node.batcher import Batcher
from talaria.node.sequence import Sequence, SeqStatus
from talaria.node.step_plan import StepPlan


class Scheduler:
    def __init__(self, instance: str, batchers: dict[str, Batcher], clock: Callable[[], float]) -> None:
        self.instance = instance
        self.batchers = batchers
        self.clock = clock
        self._seqs: dict[int, Sequence] = {}
        self._by_request: dict[str, Sequence] = {}
        self._ids = count()
        self._order = list(batchers)
        self._next = 0

    @property
    def has_work(self) -> bool:
        return any(b.has_work for b in self.batchers.values())

    def add(self, call: InstanceCall) -> list[CallOutput]:
        """Queue a call; a call that can never run is answered at once."""
        batcher = self.batchers.get(call.model)
        if batcher is None:
            return [self._error(call.request_id, f"instance {self.instance} does not serve {call.model!r}")]
        seq = Sequence(next(self._ids), call, list(call.prompt_token_ids), self.clock())
        batcher.add(seq)
        if seq.status is SeqStatus.FINISHED:
            pages = batcher.pages
            return [self._error(call.request_id, f"prompt of {len(seq.token_ids)} tokens needs "
                                f"{pages.pages_for(len(seq.token_ids) + 1)} KV pages; the pool has "
                                f"{pages.num_pages} (raise arena_bytes)")]
        self._seqs[seq.seq_id] = seq
        self._by_request[call.request_id] = seq
        return []

    def cancel(self, request_id: str) -> list[CallOutput]:
        seq = self._by_request.get(request_id)
        if seq is None:
            return []
        self.batchers[seq.model].remove(seq)
        seq.finish = FinishReason.CANCELLED
        return [self._output(seq)]

    def call_of(self, seq_id: int) -> InstanceCall:
        return self._seqs[seq_id].call

    def plan(self) -> StepPlan | None:
        """The next step: the next model (round-robin) that has something to compute."""
        for i in range(len(self._order)):
            k = (self._next + i) % len(self._order)
            plan = self.batchers[self._order[k]].plan(self.clock())
            if plan is not None:
                self._next = k + 1
                return plan
        return None

    def commit(self, plan: StepPlan, sampled: dict[int, int], step_s: float) -> list[CallOutput]:
        now = self.clock()
        for chunk in plan.chunks:
            seq = self._seqs.get(chunk.seq_id)
            if seq is not None and seq.first_token_at is None:
                seq.prefill_s += step_s
        outputs = []
        for seq in self.batchers[plan.model].commit(plan, sampled, self._seqs):
            if seq.first_token_at is None:
                seq.first_token_at = now
            seq.last_token_at = now
            outputs.append(self._output(seq))
        return outputs

    def _output(self, seq: Sequence) -> CallOutput:
        new = tuple(seq.token_ids[seq.num_prompt + seq.num_emitted:])
        seq.num_emitted += len(new)
        if seq.finish is None:
            return CallOutput(seq.call.request_id, new, committed_kv_tokens=seq.num_computed)
        self._seqs.pop(seq.seq_id, None)
        self._by_request.pop(seq.call.request_id, None)
        first = self.clock() if seq.first_token_at is None else seq.first_token_at
        scheduled = seq.arrival if seq.first_scheduled is None else seq.first_scheduled
        last = first if seq.last_token_at is None else seq.last_token_at
        timings = CallTimings(queued_s=scheduled - seq.arrival, prefill_s=seq.prefill_s,
                              decode_s=last - first, first_token_at=first)
        usage = Usage(seq.num_prompt, seq.num_generated, seq.num_cached)
        return CallOutput(seq.call.request_id, new, seq.finish, usage, seq.num_computed, timings)

    def _error(self, request_id: str, message: str) -> CallOutput:
        return CallOutput(request_id, (), FinishReason.ERROR, error=message)

    def stats(self) -> InstanceStats:
        bs = self.batchers.values()
        return InstanceStats(
            instance=self.instance,
            waiting=sum(len(b.waiting) for b in bs),
            running=sum(len(b.running) for b in bs),
            kv_pages_used=sum(b.pages.num_used for b in bs),
            kv_pages_total=sum(b.pages.num_pages for b in bs),
            preemptions=sum(b.preemptions for b in bs),
            prefix_hit_tokens=sum(b.prefix_hit_tokens for b in bs),
            models=tuple(self.batchers),
        )
