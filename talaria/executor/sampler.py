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
        follow, or anything else that broke while choosing its token); each of those got some token,
        and the caller fails that call only."""
        greedy = logits.argmax(dim=-1).tolist()
        out, failed = [], {}
        for row, (request_id, params) in enumerate(calls):
            try:
                out.append(self._choose(logits[row], greedy[row], request_id, params, model))
            except GrammarError as e:
                failed[request_id] = str(e)
                out.append(greedy[row])
            except Exception as e:  # noqa: BLE001 -- one call's failure is that call's, never the step's
                failed[request_id] = f"sampling failed: {type(e).__name__}: {e}"
                out.append(greedy[row])
        return out, failed

    def _choose(self, logits: torch.Tensor, greedy: int, request_id: str, params: SamplingParams, model: str) -> int:
        if params.grammar is not None:
            allowed = self.grammars.allowed(request_id, model, params.grammar, logits.shape[-1])
            masked = logits.float().masked_fill(~allowed, float("-inf"))
            token = int(masked.argmax()) if params.greedy else \
                self._draw(masked, params, self._generator(request_id, params))
            self.grammars.consume(request_id, token)
            return token
        if params.greedy:
            return greedy
        return self._draw(logits.float(), params, self._generator(request_id, params))

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
            drop[0] = False  # even when top_p rounds to 0 in float32
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=g))
