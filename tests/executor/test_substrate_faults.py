"""The substrate's guards under faults (paper App. B, §4.3, §4.4), with poison mode on throughout.

Each test provokes one failure the correctness conditions are there for — a TP rank that lags or
diverges, staged weight chunks overwritten by KV, a host save still in flight, a host budget too
small, a KV pool exhausted mid-decode — and checks two things: the guard costs only reuse (what is
restored shrinks to what is safe, by an exact amount where it is knowable), and the tokens still
equal an uninterrupted run of the plain cache-free reference.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from talaria.config.schema import Ablation, Pool
from talaria.contracts.call import SamplingParams
from talaria.contracts.vocabulary import KVLocation
from talaria.executor.driver import Driver
from talaria.memory import rank_ledger
from talaria.memory.stager import ChunkState
from talaria.node.engine_group import EngineGroup
from tests.executor.reference import ReferenceLlama
from tests.tiny_models import (
    GREEDY,
    arena_for_pages,
    call,
    driver,
    engine,
    instance,
    run,
    tiny_files,
    tokens,
)

PS = 4  # tokens per KV page
SUBSTRATE = {"pool": Pool.COLD, "page_size": PS, "debug_poison": True, "staging_chunk_bytes": 4096,
             "host_kv_bytes": 8 << 20, "ttft_s": 3600.0}


@pytest.fixture(scope="module")
def two(model_cache):
    """llama is active first; qwen2 (tied embeddings) has the smaller image, so it is staged whole."""
    files = [tiny_files(f, model_cache) for f in ("llama", "qwen2")]
    return files, {f.name: ReferenceLlama(f.directory) for f in files}


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def committed(prompt: list[int], max_tokens: int = GREEDY.max_tokens) -> int:
    """Tokens with KV when a call finishes: the last sampled token has none."""
    return len(prompt) + max_tokens - 1


def switch_now(core: Driver, model: str) -> None:
    """A forced switch, run at once (the step carries nothing else)."""
    core.scheduler.force_switch(model)
    assert core.step() == []
    assert core.scheduler.active == model


# ---- 1. TP prefix agreement: a lagging or diverging rank truncates what is published ----------

PROMPT = prompt_of(29, seed=7)  # 38 committed tokens after turn 1: 9 full pages, 2 tokens over
FULL = committed(PROMPT) // PS * PS  # what a healthy group publishes: 36
SHORTEN = 7  # a rank that lags by 7 tokens vouches for 31: 7 pages
CORRUPT = 3  # a rank whose hash differs from page 3 on vouches for pages 0..2


def fault_at(kind: str, rank: int) -> tuple[rank_ledger.TestOnlyFault | None, int]:
    """The fault for `kind` on `rank`, and the tokens every rank then agrees on."""
    if kind == "healthy":
        return None, FULL
    if kind == "lagging":
        return rank_ledger.TestOnlyFault(rank, shorten_tokens=SHORTEN), (committed(PROMPT) - SHORTEN) // PS * PS
    return rank_ledger.TestOnlyFault(rank, corrupt_page=CORRUPT), CORRUPT * PS


@pytest.mark.parametrize("kind", ["healthy", "lagging", "diverging"])
def test_rank_disagreement_truncates_the_restored_prefix_tp1(two, kind):
    files, refs = two
    a, b = files
    fault, agreed = fault_at(kind, rank=0)
    assert agreed == FULL if fault is None else 0 < agreed < FULL  # a fault must cost reuse
    core = driver(instance(files, **SUBSTRATE), files, fault=fault)
    first = run(core, [call("s-1", a.name, PROMPT)])["s-1"]
    switch_now(core, b.name)  # a.name's device KV is gone: only the host can give the prefix back
    switch_now(core, a.name)
    cont = PROMPT + tokens(first) + [1, 2, 3]
    out = run(core, [call("s-2", a.name, cont)])["s-2"]
    assert out[-1].usage.restored_tokens == agreed
    assert out[-1].usage.cached_tokens == agreed  # nothing else cached: the tail was recomputed
    assert tokens(out) == refs[a.name].greedy(cont, GREEDY.max_tokens)


@pytest.mark.parametrize("kind", ["lagging", "diverging"])
def test_rank_disagreement_truncates_the_restored_prefix_tp2(two, kind):
    files, refs = two
    a, b = files
    fault, agreed = fault_at(kind, rank=1)  # rank 0 (the scheduler's) is honest; rank 1 is not
    assert 0 < agreed < FULL

    async def scenario():
        group = EngineGroup(instance(files, tp=2, **SUBSTRATE), files, threads=1, fault=fault)
        await group.start()
        try:
            async def generate(rid, prompt):
                outs = [o async for o in group.generate(call(rid, a.name, prompt))]
                return [t for o in outs for t in o.token_ids], outs[-1].usage
            first, _ = await generate("s-1", PROMPT)
            away = await group.switch(b.name, 60)
            back = await group.switch(a.name, 60)
            assert away["to_model"] == b.name and back["to_model"] == a.name and len(back["ranks"]) == 2
            cont = PROMPT + first + [1, 2, 3]
            return cont, *await generate("s-2", cont)
        finally:
            await group.stop()

    cont, toks, usage = asyncio.run(scenario())
    assert usage.restored_tokens == agreed
    assert usage.cached_tokens == agreed
    assert toks == refs[a.name].greedy(cont, GREEDY.max_tokens)


# ---- 2. staging: dirty chunks come from host, clean ones device-to-device --------------------

def stage_all(core: Driver) -> None:
    """Step (nothing but memory ops) until every chunk that can be staged now is CLEAN."""
    stager = core.scheduler.memory.stager
    for _ in range(stager.num_chunks + 2):
        core.executor.substrate.wait_staging()  # the copy in flight is done, so this step marks it CLEAN
        core.step()
        writing = any(stager.state(c.index) is ChunkState.WRITING for c in stager.chunks)
        if not writing and core.stats().substrate["staging_slack_bytes"] == 0:
            return
    raise AssertionError("staging did not settle")


def weights_match_host_image(core: Driver, model: str) -> bool:
    """The arena's weights region holds exactly the host image's bytes (the rebound parameters)."""
    image = core.executor.substrate.images[model]
    return torch.equal(core.executor.substrate.arena.bytes(0, image.nbytes), image.host.bytes(0, image.nbytes))


def arena_for(files, model: str, pages: int) -> int:
    """arena_bytes that leaves `model` exactly `pages` KV pages beside every model's runtime state."""
    plan = engine(files, **SUBSTRATE).executor.substrate.layout.plan(model)
    return -(-(plan.weights.end + (pages + 1) * plan.page_bytes + plan.runtime.size) // 256) * 256 + 256


def test_dirty_staged_chunks_are_reloaded_from_host(two):
    files, refs = two
    a, b = files
    pages = 48  # the whole pool is the staging range: chunk j of b's image sits on page 47 - j
    core = engine(files, **{**SUBSTRATE, "arena_bytes": arena_for(files, a.name, pages)})
    assert core.executor.pages == pages
    stager = core.scheduler.memory.stager
    stage_all(core)
    assert len(stager.chunks) == pages and all(stager.state(c.index) is ChunkState.CLEAN for c in stager.chunks)
    long = prompt_of(120, seed=3)  # 33 pages of KV: low pages first, well into the staged range
    out = run(core, [call("long", a.name, long)])["long"]
    assert tokens(out) == refs[a.name].greedy(long, GREEDY.max_tokens)
    dirty = [c.index for c in stager.chunks if stager.state(c.index) is ChunkState.DIRTY]
    assert dirty, "the long prompt's KV must have overwritten staged chunks"
    switch_now(core, b.name)
    record = core.stats().last_switch
    rank = record["ranks"][0]
    assert record["path"] == "partial"
    assert rank["dirty_bytes"] == len(dirty) * stager.chunk_bytes
    assert 0 < rank["staged_bytes"] < rank["total_bytes"]
    assert weights_match_host_image(core, b.name), "a dirty chunk was gathered device-to-device"
    prompt = prompt_of(30, seed=4)
    assert tokens(run(core, [call("b", b.name, prompt)])["b"]) == refs[b.name].greedy(prompt, GREEDY.max_tokens)


def test_fully_staged_model_opens_device_to_device(two):
    files, refs = two
    a, b = files
    core = engine(files, **{**SUBSTRATE, "staging_chunk_bytes": 64 << 10})  # a roomy pool: no KV pressure
    prompt = prompt_of(30, seed=5)
    assert tokens(run(core, [call("a", a.name, prompt)])["a"]) == refs[a.name].greedy(prompt, GREEDY.max_tokens)
    stage_all(core)
    assert core.scheduler.memory.stager.coverage() == 1.0
    switch_now(core, b.name)
    rank = core.stats().last_switch["ranks"][0]
    assert core.stats().last_switch["path"] == "full_d2d"
    assert rank["staged_bytes"] == rank["total_bytes"] == core.executor.substrate.images[b.name].nbytes
    assert rank["dirty_bytes"] == 0
    assert weights_match_host_image(core, b.name)
    assert tokens(run(core, [call("b", b.name, prompt)])["b"]) == refs[b.name].greedy(prompt, GREEDY.max_tokens)


# ---- 3. lifetime separation: a save in flight is never restored ------------------------------
# The registry-level guard (in-flight entries are unmatchable until finish_save publishes the
# agreed pages) is unit-tested in tests/memory/test_host_kv_registry.py; here, the engine.

def test_continuation_during_a_host_save_is_served_by_the_device_cache(two):
    files, refs = two
    a = files[0]
    core = engine([a], **SUBSTRATE)
    host, memory = core.scheduler.memory.host, core.scheduler.memory
    prompt = prompt_of(29, seed=8)
    outs = core.add(call("s-1", a.name, prompt))
    while not any(o.finish for o in outs):  # step until turn 1 finishes, and not once more
        outs += core.step()
    first = tokens(outs)
    chain = core.scheduler.batchers[a.name].pages.extend_chain([], (prompt + first)[:committed(prompt)])
    assert host.stats().in_flight == len(chain)  # its save is reserved, not yet agreed
    assert host.location(a.name, chain) is KVLocation.MISSING  # so no one may read it
    cont = prompt + first + [1, 2, 3]
    outs = core.add(call("s-2", a.name, cont)) + core.step()  # admitted in the very next step
    assert memory.busy and host.stats().in_flight == len(chain), "the save must still be in flight"
    while core.has_work:
        outs += core.step()
    usage = outs[-1].usage
    assert usage.restored_tokens == 0
    assert usage.cached_tokens == len(chain) * PS  # the device pages, pinned by the save, served it
    assert tokens(outs) == refs[a.name].greedy(cont, GREEDY.max_tokens)
    assert host.location(a.name, chain) is KVLocation.HOST  # once agreed, the prefix is restorable


# ---- 4. a host budget of a few slabs: LRU eviction, restores shrink to what fits --------------

def test_small_host_budget_evicts_and_restores_what_fits(two):
    files, refs = two
    a, b = files
    slabs = 4  # of 9 full pages per session
    slab_bytes = engine(files, **SUBSTRATE).executor.substrate.slab_bytes
    core = engine(files, **{**SUBSTRATE, "host_kv_bytes": slabs * slab_bytes})
    host = core.scheduler.memory.host
    assert host.num_slabs == slabs
    prompts = {a.name: prompt_of(29, seed=11), b.name: prompt_of(29, seed=12)}
    first = {}
    for m in (a, b):  # a's session saves its first 4 pages; b's then evicts them for its own
        if core.scheduler.active != m.name:
            switch_now(core, m.name)
        first[m.name] = tokens(run(core, [call(f"{m.name}-1", m.name, prompts[m.name])])[f"{m.name}-1"])
    assert host.stats().evictions == slabs
    restored = {}
    for m, away in ((b, a), (a, None)):  # each continuation on a fresh device pool: only the host has KV
        if away is not None:
            switch_now(core, away.name)
        switch_now(core, m.name)
        cont = prompts[m.name] + first[m.name] + [1, 2, 3]
        out = run(core, [call(f"{m.name}-2", m.name, cont)])[f"{m.name}-2"]
        restored[m.name] = out[-1].usage.restored_tokens
        assert tokens(out) == refs[m.name].greedy(cont, GREEDY.max_tokens), m.name
    assert restored[b.name] == slabs * PS < committed(prompts[b.name]) // PS * PS  # only b's head fit
    assert restored[a.name] == 0  # a's pages were evicted for b's


# ---- 5. the KV pool runs out mid-decode: preempted KV goes to host and comes back -------------

@pytest.fixture(scope="module")
def exhausted(two):
    """Four 40-token generations on a 16-page pool (each needs 11): preemption, then readmission."""
    files, refs = two
    a = files[0]
    kw = {**SUBSTRATE, "staging_chunk_bytes": 0}
    core = engine([a], **{**kw, "arena_bytes": arena_for_pages(a, 16, **kw)})
    assert core.executor.pages == 16
    restores: list[tuple[int, int]] = []
    before_step = core.executor.substrate.before_step

    def spy(ops):  # records every host->device page restore the plans carry
        restores.extend(ops.restores)
        return before_step(ops)
    core.executor.substrate.before_step = spy
    sampling = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": prompt_of(12, seed=20 + i) for i in range(4)}
    outs = run(core, [call(r, a.name, p, sampling) for r, p in prompts.items()])
    expected = {r: refs[a.name].greedy(p, sampling.max_tokens) for r, p in prompts.items()}
    return core, outs, expected, restores


def test_preempted_kv_is_restored_from_host_and_outputs_match(exhausted):
    core, outs, expected, restores = exhausted
    assert core.stats().preemptions > 0
    # every prompt is distinct, so a host hit can only be a preempted sequence coming back
    assert all(o[-1].usage.restored_tokens == 0 for o in outs.values())
    assert restores, "no preempted sequence was readmitted from host"
    assert {r: tokens(o) for r, o in outs.items()} == expected


def test_preemption_host_restores_show_in_instance_stats(exhausted):
    core, _, _, restores = exhausted
    assert core.stats().host_restored_tokens == len(restores) * PS


def test_without_hkvr_a_switch_swaps_a_running_call_out_and_back_and_outputs_match(two):
    """HKVR ablated (poison on): a call still decoding when its model is switched away is saved to
    host and restored when its model is back, and yields the uninterrupted run's tokens; the
    session's next call finds nothing on host (HKVR proper is off) and is recomputed."""
    files, refs = two
    a, b = files
    core = engine(files, **{**SUBSTRATE, "ablations": (Ablation.HKVR,)})
    restores: list[tuple[int, int]] = []
    before_step = core.executor.substrate.before_step

    def spy(ops):
        restores.extend(ops.restores)
        return before_step(ops)
    core.executor.substrate.before_step = spy
    prompt = prompt_of(29, seed=9)
    outs = core.add(call("s-1", a.name, prompt))
    while len(tokens(outs)) < 3:  # its prompt is in, three tokens decoded: still running
        outs += core.step()
    switch_now(core, b.name)  # the slot closes under it
    rest = run(core, [call("o-1", b.name, prompt_of(17, seed=10))])  # b's call, then back to a for s-1
    assert tokens(rest["o-1"]) == refs[b.name].greedy(prompt_of(17, seed=10), GREEDY.max_tokens)
    first = tokens(outs + rest["s-1"])
    assert first == refs[a.name].greedy(prompt, GREEDY.max_tokens)
    assert len(restores) == (len(prompt) + 2) // PS  # its full pages at the switch came back from host
    assert core.stats().lost_tokens == 0
    cont = prompt + first + [1, 2, 3]
    switch_now(core, b.name)
    switch_now(core, a.name)
    out = run(core, [call("s-2", a.name, cont)])["s-2"]
    assert out[-1].usage.cached_tokens == 0 and out[-1].usage.restored_tokens == 0
    assert tokens(out) == refs[a.name].greedy(cont, GREEDY.max_tokens)
