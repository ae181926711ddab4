"""What prefilling a prompt's next chunk costs on a cold instance: the prices the round scheduler
sizes P and SP chunks by, ranks SP candidates by (talaria/instance/sp_batch.py), and predicts a
round's P phases with.

A waiting prompt reuses the prefix this instance holds (device pages, or host pages it restores
first) and prefills the rest; a running one continues from its computed tokens. Prices come from
the instance's CostModel, so they carry its EWMA corrections. Plain arithmetic, no side effects.
"""

from __future__ import annotations

import math

from talaria.instance.batcher import Batcher
from talaria.instance.cost_model import CostModel
from talaria.instance.sequence import SeqStatus, Sequence


class PromptCosts:
    def __init__(self, costs: CostModel, page_size: int, min_chunk: int) -> None:
        self.costs = costs
        self.page_size = page_size
        self.min_chunk = min_chunk  # the smallest prefill chunk worth a step

    def p_phase(self, model: str, b: Batcher, max_batch_tokens: int) -> tuple[float, float]:
        """(the fixed cost of its first step, its predicted seconds) for a P that prefills what waits
        in `b`: each prompt its restore and its tail (`work`), in steps of `max_batch_tokens` that
        each pay the fixed cost once; (0, 0) when nothing waits."""
        if not b.waiting:
            return 0.0, 0.0
        tails = [self.tail(model, b, seq) for seq in b.waiting]
        fixed = self.costs.prefill_fixed_s(model)
        steps = max(1, math.ceil(sum(todo for _, _, todo in tails) / max_batch_tokens))
        return fixed, steps * fixed + sum(self._batched(model, *t) for t in tails)

    def tail(self, model: str, b: Batcher, seq: Sequence) -> tuple[int, float, int]:
        """(tokens whose KV it has or can reuse, seconds to restore those from host, tokens left to prefill)."""
        if seq.status is SeqStatus.RUNNING:
            return seq.num_computed, 0.0, seq.num_uncomputed
        on_device, on_host, host_states = b.reusable(seq)
        cached = (on_device + on_host) * self.page_size
        restore = self.costs.restore_s(model, on_host * self.page_size, states=host_states)
        return cached, restore, len(seq.token_ids) - cached

    def work(self, model: str, b: Batcher, seq: Sequence) -> float:
        """Its whole prefill as a chunk of a step that pays the fixed cost already: restore and tail."""
        return self._batched(model, *self.tail(model, b, seq))

    def _batched(self, model: str, cached: int, restore: float, todo: int) -> float:
        """A `tail` as a chunk of a step that pays the fixed cost already."""
        return restore + self.costs.prefill_s(model, todo, cached, batched=True)

    def fit(self, model: str, b: Batcher, seq: Sequence, budget: float, tokens: int,
            batched: bool = False) -> tuple[int, float]:
        """The most prompt tokens of `seq` (at most `tokens`) whose prefill, plus its restore when it
        is not admitted yet, fits `budget`; 0 when not even the smallest chunk does. `batched`: the
        step has a chunk already, which pays the forward's fixed cost (as `Profile.step_s` prices it)."""
        cached, restore, todo = self.tail(model, b, seq)
        hi = min(todo, tokens)
        lo = min(hi, self.min_chunk)

        def cost(n: int) -> float:
            return restore + self.costs.prefill_s(model, n, cached, batched)

        if lo <= 0 or cost(lo) > budget:
            return 0, 0.0
        while lo < hi:  # the largest n in [lo, hi] with cost(n) <= budget (cost grows with n)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid - 1)
        n = b.chunk_tokens(seq, cached, lo)  # the chunk the batcher will build of them (a stateful cache's ends on a page)
        return n, cost(n)
