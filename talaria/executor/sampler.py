"""Next-token choice from logits: greedy, or temperature / top-k / top-p with a per-call seed.

Each call draws from its own torch.Generator, so a seeded call gives the same tokens whatever else
shares its batches, and a preempted call continues the same random stream when it is recomputed.
A call with a grammar draws only among the tokens its grammar allows (talaria/executor/grammar_masks.py);
the other calls of the batch are untouched.
"""

from __future__ import annotations

import torch

from talaria.contracts.call import SamplingParams
from talaria.executor.grammar_masks import GrammarError, GrammarMasks


class Sampler:
    def __init__(self, grammars: GrammarMasks | None = None, seed: int = 0) -> None:
        self._seeds = torch.Generator().manual_seed(seed)  # seeds calls that bring none
        self._generators: dict[str, torch.Generator] = {}
        self.grammars = grammars if grammars is not None else GrammarMasks({})

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self.grammars.forget(request_id)

    def sample(self, logits: torch.Tensor, calls: list[tuple[str, SamplingParams]],
               model: str = "") -> tuple[list[int], dict[str, str]]:
        """logits: (S, V), one row per call in `calls` (request id, params) of `model`. Returns the
        tokens, and the calls that cannot go on (request id -> why: a grammar the vocabulary cannot
        follow); each of those got some token, and the caller fails it."""
        greedy = logits.argmax(dim=-1).tolist()
        out, failed = [], {}
        for row, (request_id, params) in enumerate(calls):
            if params.grammar is not None:
                try:
                    allowed = self.grammars.allowed(request_id, model, params.grammar, logits.shape[-1])
                except GrammarError as e:
                    failed[request_id] = str(e)
                    out.append(greedy[row])
                    continue
                row_logits = logits[row].float().masked_fill(~allowed, float("-inf"))
                token = int(row_logits.argmax()) if params.greedy else \
                    self._draw(row_logits, params, self._generator(request_id, params))
                self.grammars.consume(request_id, token)
                out.append(token)
            elif params.greedy:
                out.append(greedy[row])
            else:
                out.append(self._draw(logits[row].float(), params, self._generator(request_id, params)))
        return out, failed

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
