"""Next-token choice from logits: greedy, or temperature / top-k / top-p with a per-call seed.

Each call draws from its own torch.Generator, so a seeded call gives the same tokens whatever else
shares its batches, and a preempted call continues the same random stream when it is recomputed.
"""

from __future__ import annotations

import torch

from talaria.contracts.call import SamplingParams


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._seeds = torch.Generator().manual_seed(seed)  # seeds calls that bring none
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, calls: list[tuple[str, SamplingParams]]) -> list[int]:
        """logits: (S, V), one row per call in `calls` (request id, params)."""
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for row, (request_id, params) in enumerate(calls):
            if params.greedy:
                out.append(greedy[row])
                continue
            out.append(self._draw(logits[row].float(), params, self._generator(request_id, params)))
        return out

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        g = self._generators.get(request_id)
        if g is None:
            seed = params.seed if params.seed is not None else int(
                torch.randint(0, 2**62, (1,), generator=self._seeds))
            g = self._generators[request_id] = torch.Generator().manual_seed(seed)
        return g

    @staticmethod
    def _draw(logits: torch.Tensor, params: SamplingParams, g: torch.Generator) -> int:
        logits = logits / params.temperature
        if 0 < params.top_k < logits.shape[-1]:
            kth = torch.topk(logits, params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest set whose mass reaches top_p (the first token always stays)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=g))
