"""Next-token choice from logits: greedy, or temperature / top-k / top-p with a per-call seed.

Each call draws from its own torch.Generator, created on the logits' device, so a seeded call gives
the same tokens whatever else shares its batches, and a preempted call continues the same random
stream when it is recomputed. The maths runs once for all sampled rows of a step, on the device:
each row's generator only fills that row's noise, and the whole step costs one host sync (the
tokens' `.tolist()`). A call with a grammar draws only among the tokens its grammar allows
(talaria/executor/grammar_masks.py); the other calls of the batch are untouched.

The draw is `argmax(probs / E)` with E ~ Exp(1) drawn per vocabulary entry: the exponential race,
which is exactly how `torch.multinomial(probs, 1, generator=g)` draws one sample, so a seeded call
draws the tokens it drew when each row was sampled alone with `multinomial`.

A call's seed reaches its generator through `generator_seed`, a 64-bit mix (SplitMix64's
finalizer): torch's CPU generator keeps only the low 32 bits of what it is seeded with, so seeds
that differ only above bit 32 (0 and 2^63, 2^63 - 1 and 2^64 - 1) would otherwise draw the same
tokens. After the mix every bit of the seed moves the low 32, and two seeds share a stream only by
a 2^-32 chance. A negative seed is its 64-bit two's complement (-1 is 2^64 - 1), as torch takes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from talaria.contracts.call import SamplingParams
from talaria.executor.grammar_masks import GrammarError, GrammarMasks

_U64 = 2**64 - 1


def generator_seed(seed: int) -> int:
    """What a call's seed, an integer in [-2^63, 2^64 - 1], seeds its generator with (the module
    docstring); a seed outside that range is a ValueError, which fails that call alone."""
    if not -(2**63) <= seed <= _U64:
        raise ValueError(f"seed {seed} is outside [-2^63, 2^64 - 1]")
    z = (seed + 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


@dataclass(frozen=True, slots=True)
class DrawParams:
    """The sampled rows' settings as (R, 1) tensors on the logits' device."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64; the vocabulary size where a row has no top-k cut
    top_p: torch.Tensor  # float32; +inf where a row has no top-p cut
    cut_k: bool  # some row has a top-k cut (else the sort is skipped)
    cut_p: bool  # some row has a top-p cut

    @staticmethod
    def of(params: list[SamplingParams], vocab: int, device: torch.device) -> DrawParams:
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        ps = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]

        def col(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=dtype).view(-1, 1), device)
        return DrawParams(col([p.temperature for p in params], torch.float32), col(ks, torch.int64),
                          col(ps, torch.float32), any(k < vocab for k in ks), any(p < 1.0 for p in ps))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`, pinned first on CUDA: the copy is queued behind the step's
    work instead of waiting for it, as a copy from pageable memory may."""
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def draw(scores: torch.Tensor, params: DrawParams, noise: torch.Tensor) -> torch.Tensor:
    """scores, noise: (R, V) float32, noise ~ Exp(1). Returns (R,) tokens: temperature, then the
    top-k cut, softmax, the top-p cut (the smallest set whose mass reaches top_p; the first token
    always stays), then the exponential race."""
    scores = scores / params.temperature
    if params.cut_k:
        kth = scores.sort(dim=-1, descending=True).values.gather(-1, params.top_k - 1)  # (R, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.cut_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        drop[:, 0] = False  # even when top_p rounds to 0 in float32
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return (probs / noise).argmax(dim=-1)


def broken(scores: torch.Tensor) -> torch.Tensor:
    """(R,) True where a row's scores make no distribution (NaN or +inf logits, nothing allowed)."""
    finite = torch.isfinite(scores) | (scores == float("-inf"))
    return ~finite.all(dim=-1) | (scores == float("-inf")).all(dim=-1)


class Sampler:
    def __init__(self, grammars: GrammarMasks | None = None, seed: int = 0) -> None:
        # seeds calls that bring none; drawn on the host on purpose: the seed is a Python int that
        # `manual_seed` takes, and drawing it on the device would cost a sync per unseeded call
        self._seeds = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}  # request id -> its stream, on the logits' device
        self.grammars = grammars if grammars is not None else GrammarMasks({})

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self.grammars.forget(request_id)

    def sample(self, logits: torch.Tensor, calls: list[tuple[str, SamplingParams]],
               model: str = "") -> tuple[list[int], dict[str, str]]:
        """logits: (S, V), one row per call in `calls` (request id, params) of `model`. Returns the
        tokens, and the calls that cannot go on (request id -> why: a grammar the vocabulary cannot
        follow, or anything else that broke while choosing its token); each of those got its greedy
        token, and the caller fails that call only."""
        failed: dict[str, str] = {}
        constrained = [row for row, (_, p) in enumerate(calls) if p.grammar is not None]
        scores = logits.to(torch.float32, copy=bool(constrained))  # (S, V); a copy when masked in place
        for row in constrained:
            request_id, params = calls[row]
            try:
                allowed = self.grammars.allowed(request_id, model, params.grammar, logits.shape[-1])
                scores[row].masked_fill_(~to_device(allowed, scores.device), float("-inf"))
            except GrammarError as e:
                failed[request_id] = str(e)
            except Exception as e:  # noqa: BLE001 -- one call's failure is that call's, never the step's
                failed[request_id] = f"sampling failed: {type(e).__name__}: {e}"
        rows, noise = self._noise(scores, calls, failed)
        chosen = scores.argmax(dim=-1)  # (S,): greedy rows, and constrained greedy rows, as they are
        bad = torch.zeros_like(chosen)
        if rows:
            try:
                index = to_device(torch.tensor(rows), scores.device)
                params = DrawParams.of([calls[r][1] for r in rows], scores.shape[-1], scores.device)
                chosen = chosen.index_copy(0, index, draw(scores[index], params, noise))
                bad = bad.index_copy(0, index, broken(scores[index]).long())
            except Exception as e:  # noqa: BLE001 -- the batched maths broke: no single call to blame
                for r in rows:
                    failed[calls[r][0]] = f"sampling failed: {type(e).__name__}: {e}"
        greedy, chosen, bad = torch.stack((logits.argmax(dim=-1), chosen, bad)).tolist()  # the one sync
        tokens = []
        for row, (request_id, params) in enumerate(calls):
            if bad[row] and request_id not in failed:
                failed[request_id] = "sampling failed: the logits are not a distribution (NaN or inf)"
            if request_id in failed:
                tokens.append(greedy[row])
                continue
            if params.grammar is not None:
                try:
                    self.grammars.consume(request_id, chosen[row])
                except Exception as e:  # noqa: BLE001 -- that call's grammar broke: fail it alone
                    failed[request_id] = f"sampling failed: {type(e).__name__}: {e}"
                    tokens.append(greedy[row])
                    continue
            tokens.append(chosen[row])
        return tokens, failed

    def _noise(self, scores: torch.Tensor, calls: list[tuple[str, SamplingParams]],
               failed: dict[str, str]) -> tuple[list[int], torch.Tensor]:
        """The rows that draw, and their Exp(1) noise (R, V), each row from its call's generator."""
        rows = [r for r, (rid, p) in enumerate(calls) if not p.greedy and rid not in failed]
        noise = torch.empty(len(rows), scores.shape[-1], dtype=torch.float32, device=scores.device)
        kept = []
        for i, row in enumerate(rows):
            request_id, params = calls[row]
            try:
                noise[i].exponential_(generator=self._generator(request_id, params, scores.device))
                kept.append(i)
            except Exception as e:  # noqa: BLE001 -- e.g. a seed no generator takes: that call fails alone
                failed[request_id] = f"sampling failed: {type(e).__name__}: {e}"
        if len(kept) < len(rows):
            noise = noise[kept]
            rows = [rows[i] for i in kept]
        return rows, noise

    def _generator(self, request_id: str, params: SamplingParams, device: torch.device) -> torch.Generator:
        g = self._generators.get(request_id)
        if g is None:
            seed = params.seed if params.seed is not None else int(
                torch.randint(0, 2**62, (1,), generator=self._seeds))
            g = torch.Generator(device=device)
            g.manual_seed(generator_seed(seed))
            self._generators[request_id] = g  # only once seeded: a seed that fails leaves no stream behind
        return g
