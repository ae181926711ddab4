"""Equality rule on tiny random models (float64): whatever the engine does — batching prompts of
different lengths, paged KV, prefix-cache hits, chunked prefill, preemption and recompute — greedy
tokens equal a plain full-recompute reference."""

from __future__ import annotations

import random

import pytest

from talaria.executor import attention
from tests.executor.reference import ReferenceLlama
from tests.tiny_models import (
    GREEDY,
    arena_for_pages,
    call,
    engine,
    run,
    tiny_files,
    tokens,
)


def prompts(n: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(files):
        if files.name not in cache:
            cache[files.name] = ReferenceLlama(files.directory)
        return cache[files.name]
    return get


def expect(ref: ReferenceLlama, prompt, n: int = GREEDY.max_tokens) -> list[int]:
    return ref.greedy(list(prompt), n)


def test_batched_prompts_of_different_lengths(tiny, references):
    ps = prompts(6, [1, 3, 4, 5, 17, 70])
    outs = run(engine([tiny]), [call(str(i), tiny.name, p) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert tokens(outs[str(i)]) == expect(references(tiny), p), f"prompt {i} (len {len(p)})"
        assert outs[str(i)][-1].usage.completion_tokens == GREEDY.max_tokens


def test_prefix_cache_hit_reuses_pages_and_keeps_tokens(tiny, references):
    core = engine([tiny], page_size=4)
    base = prompts(1, [30], seed=1)[0]
    first = run(core, [call("a", tiny.name, base)])
    assert first["a"][-1].usage.cached_tokens == 0
    cont = base + tokens(first["a"]) + [7, 8, 9]  # a session's next call: prompt + output + new turn
    second = run(core, [call("b", tiny.name, cont)])
    # every full page of prompt + generated KV (all but the last sampled token) is reused
    assert second["b"][-1].usage.cached_tokens == (len(base) + GREEDY.max_tokens - 1) // 4 * 4
    assert tokens(second["b"]) == expect(references(tiny), cont)


def test_identical_prompt_hits_all_but_the_last_token(tiny, references):
    core = engine([tiny], page_size=4)
    p = prompts(1, [24], seed=2)[0]
    run(core, [call("a", tiny.name, p)])
    again = run(core, [call("b", tiny.name, p)])
    assert again["b"][-1].usage.cached_tokens == 20  # 24 tokens, one must be recomputed: 5 of 6 pages
    assert tokens(again["b"]) == expect(references(tiny), p)


def test_calls_sharing_a_cached_prefix_decode_it_once_and_keep_tokens(model_cache, references, monkeypatch):
    """Calls that reuse one prompt's pages (an agent fleet's system prompt) decode together, reading
    the shared pages once for the batch (talaria/executor/attention.py): tokens as the reference.
    One family: the attention path is the same for all."""
    shared_steps = []
    original = attention._shared_prefix_attention
    monkeypatch.setattr(attention, "_shared_prefix_attention",
                        lambda *a: shared_steps.append(1) or original(*a))
    llama = tiny_files("llama", model_cache)
    core = engine([llama], page_size=4)
    prefix = prompts(1, [24], seed=5)[0]
    run(core, [call("p", llama.name, prefix)])
    ps = [prefix + tail for tail in prompts(3, [1, 2, 3], seed=6)]
    outs = run(core, [call(str(i), llama.name, p) for i, p in enumerate(ps)])
    assert shared_steps, "the calls should have decoded with a shared part"
    for i, p in enumerate(ps):
        assert outs[str(i)][-1].usage.cached_tokens >= 24
        assert tokens(outs[str(i)]) == expect(references(llama), p), f"call {i}"


def test_groups_sharing_different_cached_prefixes_decode_together_and_keep_tokens(model_cache, references,
                                                                                  monkeypatch):
    """Two agent kinds (two cached prompts), four calls on each and one call of its own, decode in one
    batch: each group reads its own prefix once (talaria/executor/attention.py), tokens as the reference."""
    shared_parts = []  # per step: how many of its decode batches read a shared prefix once
    original = attention._decode_batches

    def spy(*args):
        batches = original(*args)
        shared_parts.append(sum(d.shared is not None for d in batches))
        return batches
    monkeypatch.setattr(attention, "_decode_batches", spy)
    llama = tiny_files("llama", model_cache)
    core = engine([llama], page_size=4)
    prefixes = prompts(2, [24], seed=7)
    run(core, [call(f"p{j}", llama.name, p) for j, p in enumerate(prefixes)])
    ps = [prefix + tail for prefix in prefixes for tail in prompts(4, [1, 2, 3], seed=8)] + prompts(1, [9], seed=9)
    outs = run(core, [call(str(i), llama.name, p) for i, p in enumerate(ps)])
    assert max(shared_parts) == 2, "the two groups should have decoded in one step, each with its shared part"
    for i, p in enumerate(ps):
        assert outs[str(i)][-1].usage.cached_tokens == (24 if i < 8 else 0)  # the loner shares nothing
        assert tokens(outs[str(i)]) == expect(references(llama), p), f"call {i}"


def test_calls_started_together_on_one_prompt_prefix_compute_it_once(model_cache, references):
    """Agents started together with one system prompt: the first computes it, the others wait a step
    and read it from the prefix cache (talaria/instance/batcher.py), with the reference's tokens."""
    llama = tiny_files("llama", model_cache)
    core = engine([llama], page_size=4)  # a step's budget (64 tokens) holds two of these prompts
    prefix = prompts(1, [24], seed=7)[0]
    ps = [prefix + tail for tail in prompts(4, [1, 2, 3], seed=8)]
    outs = run(core, [call(str(i), llama.name, p) for i, p in enumerate(ps)])
    assert [outs[str(i)][-1].usage.cached_tokens for i in range(4)] == [0, 24, 24, 24]
    for i, p in enumerate(ps):
        assert tokens(outs[str(i)]) == expect(references(llama), p), f"call {i}"


def test_chunked_prefill_advances_long_prompts_in_chunks(tiny, references):
    core = engine([tiny], max_batch_tokens=8)
    long_prompt, short = prompts(2, [61, 3], seed=3)
    plans = []
    real_plan = core.scheduler.plan

    def spy():
        plan = real_plan()
        if plan is not None:
            plans.append(plan)
        return plan
    core.scheduler.plan = spy
    outs = run(core, [call("short", tiny.name, short), call("long", tiny.name, long_prompt)])
    assert all(p.num_tokens <= 8 for p in plans)
    long_chunks = [c for p in plans for c in p.chunks if len(c.token_ids) > 1 and c.start_pos > 0]
    assert len(long_chunks) >= 6  # 61 prompt tokens in chunks of at most 8
    # the short call decodes in every step while the long one prefills: decode is never blocked
    decode_steps = [p for p in plans if any(len(c.token_ids) == 1 for c in p.chunks)]
    assert len(decode_steps) >= GREEDY.max_tokens - 1
    assert tokens(outs["long"]) == expect(references(tiny), long_prompt)
    assert tokens(outs["short"]) == expect(references(tiny), short)


def test_preemption_recomputes_and_keeps_tokens(tiny, references):
    # each call needs ceil((20 + 24) / 4) = 11 pages; a 24-page pool cannot hold four at once
    files = [tiny]
    core = engine(files, arena_bytes=arena_for_pages(tiny, 24))
    assert core.executor.pages == 24
    sampling = GREEDY.__class__(max_tokens=24, temperature=0.0, ignore_eos=True)
    ps = prompts(4, [20], seed=4)
    outs = run(core, [call(str(i), tiny.name, p, sampling) for i, p in enumerate(ps)])
    assert core.stats().preemptions > 0
    for i, p in enumerate(ps):
        assert tokens(outs[str(i)]) == expect(references(tiny), p, 24), f"call {i}"


def test_calls_to_two_models_of_one_instance_interleave(model_cache, references):
    a, b = tiny_files("llama", model_cache), tiny_files("qwen3", model_cache)
    core = engine([a, b])
    ps = prompts(4, [9, 14], seed=5)
    calls = [call(f"{m.name}-{i}", m.name, p) for i, p in enumerate(ps) for m in (a, b)]
    outs = run(core, calls)
    for i, p in enumerate(ps):
        for m in (a, b):
            assert tokens(outs[f"{m.name}-{i}"]) == expect(references(m), p)


def test_cancel_releases_pages(tiny):
    core = engine([tiny])
    sampling = GREEDY.__class__(max_tokens=200, temperature=0.0, ignore_eos=True)
    core.add(call("x", tiny.name, prompts(1, [30])[0], sampling))
    for _ in range(5):
        core.step()
    assert core.stats().kv_pages_used > 0
    out = core.cancel("x")
    assert out[-1].finish.value == "cancelled"
    while core.has_work:  # the cancelled KV is checkpointed to host; its pages free once that is agreed
        core.step()
    assert core.stats().kv_pages_used == 0


def test_prompt_larger_than_the_pool_fails_fast(tiny):
    files = [tiny]
    core = engine(files, arena_bytes=arena_for_pages(tiny, 9))
    out = core.add(call("big", tiny.name, list(range(100))))
    assert out and out[0].finish.value == "error" and "raise arena_bytes" in out[0].error
    assert not core.has_work
