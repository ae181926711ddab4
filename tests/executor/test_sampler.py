"""Sampler on toy logits: greedy cases, per-request seeded streams, and the shape of the draws."""

from __future__ import annotations

from collections import Counter

import torch

from talaria.contracts.call import SamplingParams
from talaria.executor.sampler import Sampler, generator_seed
from tests.tiny_models import engine_device

V = 8
FLAT = torch.zeros(V)  # uniform: every draw is informative about the random stream


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


def sample(sampler: Sampler, logits: torch.Tensor, calls: list[tuple[str, SamplingParams]]) -> list[int]:
    tokens, failed = sampler.sample(logits, calls)
    assert failed == {}
    return tokens


def draws(sampler: Sampler, request_id: str, params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    return [sample(sampler, logits[None], [(request_id, params)])[0] for _ in range(n)]


def chi_square(counts: Counter, probs: torch.Tensor, n: int) -> float:
    return sum((counts[i] - n * float(p)) ** 2 / (n * float(p)) for i, p in enumerate(probs))


def test_greedy_is_argmax_of_every_row():
    logits = random_logits(6)
    params = SamplingParams(temperature=0.0)
    out = sample(Sampler(), logits, [(f"r{i}", params) for i in range(6)])
    assert out == logits.argmax(dim=-1).tolist()


def test_top_k_one_is_greedy_whatever_the_temperature():
    logits = random_logits(6, seed=1)
    sampler = Sampler()
    for temperature in (0.5, 1.0, 10.0):
        params = SamplingParams(temperature=temperature, top_k=1, seed=3)
        for _ in range(5):
            assert sample(sampler, logits, [(f"r{i}", params) for i in range(6)]) == logits.argmax(dim=-1).tolist()


def test_a_very_small_top_p_is_greedy():
    logits = random_logits(1, seed=2)[0]
    params = SamplingParams(temperature=1.0, top_p=1e-6, seed=4)
    assert draws(Sampler(), "r", params, logits, 200) == [int(logits.argmax())] * 200


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch():
    x = SamplingParams(seed=7)
    alone = draws(Sampler(), "x", x, FLAT, 20)

    sampler = Sampler(seed=99)
    other_logits = random_logits(2, seed=5)
    shared = []
    for i in range(20):
        others = [("y", SamplingParams(seed=3)), (f"z{i}", SamplingParams())]  # a new unseeded call each step
        rows = [("x", x)] + others if i % 2 else others + [("x", x)]
        logits = torch.stack([FLAT if rid == "x" else other_logits[j % 2] for j, (rid, _) in enumerate(rows)])
        out = sample(sampler, logits, rows)
        shared.append(out[[rid for rid, _ in rows].index("x")])
        if i % 3 == 0:  # a batch without x, with another request seeded like x
            sample(sampler, other_logits, [("w", SamplingParams(seed=7)), ("v", SamplingParams())])
    assert shared == alone


def test_different_seeds_give_different_draws():
    a = draws(Sampler(), "r", SamplingParams(seed=1), FLAT, 50)
    b = draws(Sampler(), "r", SamplingParams(seed=2), FLAT, 50)
    assert a != b
    assert len(set(a)) > 1


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([0.0, 1.0, 2.0])
    n = 4000
    for temperature in (1.0, 2.0):
        params = SamplingParams(temperature=temperature, seed=11)
        counts = Counter(draws(Sampler(), "r", params, logits, n))
        probs = torch.softmax(logits / temperature, dim=-1)
        # chi-square with 2 degrees of freedom: 13.8 is its 99.9 % quantile
        assert chi_square(counts, probs, n) < 13.8, (temperature, counts)
        # and the temperature matters: the other temperature's softmax is rejected
        other = torch.softmax(logits / (3.0 - temperature), dim=-1)
        assert chi_square(counts, other, n) > 100, (temperature, counts)


def test_top_k_never_draws_outside_the_top_k():
    logits = torch.tensor([3.0, 0.0, 2.9, -1.0, 2.8, 0.5])
    counts = Counter(draws(Sampler(), "r", SamplingParams(temperature=1.0, top_k=2, seed=5), logits, 2000))
    assert set(counts) == {0, 2}


def test_top_p_keeps_the_smallest_set_reaching_its_mass():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    counts = Counter(draws(Sampler(), "r", SamplingParams(top_p=0.7, seed=6), logits, 2000))
    assert set(counts) == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3


def test_forget_resets_a_requests_stream():
    sampler = Sampler()
    params = SamplingParams(seed=8)
    first = draws(sampler, "r", params, FLAT, 20)
    continued = draws(sampler, "r", params, FLAT, 20)
    assert continued != first  # without forget, the stream goes on
    sampler.forget("r")
    assert draws(sampler, "r", params, FLAT, 20) == first


def test_one_call_that_cannot_be_sampled_fails_alone():
    """A seed no torch.Generator takes (the gateway refuses it; here it got through): that call is
    failed, the others of the batch sample as they would have."""
    logits = random_logits(3, seed=4)
    calls = [("a", SamplingParams(temperature=1.0, seed=1)), ("bad", SamplingParams(temperature=1.0, seed=2**70)),
             ("c", SamplingParams(temperature=0.0))]
    tokens, failed = Sampler().sample(logits, calls)
    assert list(failed) == ["bad"] and failed["bad"].startswith("sampling failed:")
    alone = sample(Sampler(), logits[[0, 2]], [calls[0], calls[2]])
    assert [tokens[0], tokens[2]] == alone


def test_seeds_that_differ_only_in_their_high_bits_draw_different_streams():
    """torch's CPU generator keeps a seed's low 32 bits: seeded as sent, 0, 2^32 and 2^63 drew the
    same tokens, as did 2^63 - 1 and 2^64 - 1. A negative seed is its two's complement: -1 draws
    2^64 - 1's stream, -2^63 draws 2^63's."""
    logits = torch.zeros(4096)  # uniform: every draw is the stream's own
    seeds = (0, 2**32, 2**63, 2**63 - 1, 2**64 - 1)
    streams = {s: draws(Sampler(), "r", SamplingParams(seed=s), logits, 8) for s in seeds}
    assert len(set(map(tuple, streams.values()))) == len(seeds), streams
    assert draws(Sampler(), "r", SamplingParams(seed=-1), logits, 8) == streams[2**64 - 1]
    assert draws(Sampler(), "r", SamplingParams(seed=-(2**63)), logits, 8) == streams[2**63]


def test_vanishing_temperature_and_top_p_choose_the_top_token():
    logits = random_logits(4, seed=5)
    top = logits.argmax(-1).tolist()
    for params in (SamplingParams(temperature=1e-300), SamplingParams(top_p=1e-300, seed=3),
                   SamplingParams(temperature=1e-6, top_p=1e-300)):
        assert sample(Sampler(), logits, [(str(i), params) for i in range(4)]) == top


# ---- the vectorised draw against the row-at-a-time multinomial it replaced ------------------

def multinomial_draw(logits: torch.Tensor, params: SamplingParams, g: torch.Generator) -> int:
    """The sampler as it was: one row at a time, `torch.multinomial` with the call's generator."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        drop[0] = False
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=g))


MIXED = [SamplingParams(seed=1), SamplingParams(temperature=0.7, seed=2), SamplingParams(top_k=5, seed=3),
         SamplingParams(temperature=1.3, top_p=0.8, seed=4), SamplingParams(top_k=40, top_p=0.95, seed=5),
         SamplingParams(temperature=0.0, seed=6), SamplingParams(top_k=1000, top_p=0.5, seed=7)]


def test_seeded_batched_draws_equal_row_at_a_time_multinomial():
    """Vectorising kept every seeded call's random stream: the same tokens, step after step."""
    device = engine_device()
    vocab, steps = 300, 12
    sampler = Sampler()
    gens = {i: torch.Generator(device=device).manual_seed(generator_seed(p.seed)) for i, p in enumerate(MIXED)}
    for step in range(steps):
        logits = (3 * torch.randn(len(MIXED), vocab, generator=torch.Generator().manual_seed(step))).to(device)
        got = sample(sampler, logits, [(f"r{i}", p) for i, p in enumerate(MIXED)])
        want = [int(logits[i].argmax()) if p.greedy else multinomial_draw(logits[i].float(), p, gens[i])
                for i, p in enumerate(MIXED)]
        assert got == want, step


def test_generators_are_made_on_the_logits_device(monkeypatch):
    device = engine_device()
    sampler = Sampler()
    logits = random_logits(3).to(device)
    made = []
    real = torch.Generator

    def recording(*args, **kwargs):
        made.append(kwargs.get("device", args[0] if args else None))  # None: the default, the CPU
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "Generator", recording)
    sample(sampler, logits, [("seeded", SamplingParams(seed=1)), ("unseeded", SamplingParams()),
                             ("greedy", SamplingParams(temperature=0.0))])
    assert made == [logits.device, logits.device]  # the two that draw; greedy calls make none
    assert {g.device for g in sampler._generators.values()} == {logits.device}
    assert set(sampler._generators) == {"seeded", "unseeded"}


def test_logits_that_are_no_distribution_fail_their_call_alone():
    logits = random_logits(3, seed=6)
    logits[1, 2] = float("nan")
    calls = [("a", SamplingParams(seed=1)), ("nan", SamplingParams(seed=2)), ("c", SamplingParams(seed=3))]
    tokens, failed = Sampler().sample(logits, calls)
    assert list(failed) == ["nan"] and "not a distribution" in failed["nan"]
    alone = sample(Sampler(), logits[[0, 2]], [calls[0], calls[2]])
    assert [tokens[0], tokens[2]] == alone
