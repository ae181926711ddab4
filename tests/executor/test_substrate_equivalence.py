"""The paper's validation protocol (App. B) with poison mode on: sessions on three models of one
cold instance, continued after forced switches. Every continuation is restored from the host KV
registry (asserted: a host hit, not a recompute) and yields the tokens of an uninterrupted
single-model run of the plain reference, at TP=1 in-process and TP=2 over gloo."""

from __future__ import annotations

import asyncio
import random

import pytest

from talaria.config.schema import Pool
from talaria.contracts.call import InstanceCall
from talaria.node.engine_group import EngineGroup
from tests.executor.reference import ReferenceLlama
from tests.tiny_models import GREEDY, engine, instance, run, tiny_files, tokens

FAMILIES = ("llama", "qwen2", "qwen3")
SUBSTRATE = {"pool": Pool.COLD, "page_size": 4, "debug_poison": True, "staging_chunk_bytes": 4096,
             "host_kv_bytes": 8 << 20, "ttft_s": 3600.0}


@pytest.fixture(scope="module")
def three(model_cache):
    files = [tiny_files(f, model_cache) for f in FAMILIES]
    return files, {f.name: ReferenceLlama(f.directory) for f in files}


def sessions(files, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f.name: [rng.randrange(256) for _ in range(rng.randrange(18, 40))] for f in files}


def test_switches_restore_every_session_from_host_tp1(three):
    files, refs = three
    core = engine(files, **SUBSTRATE)
    prompts = sessions(files)
    turn1 = {}
    for f in files:  # turn 1 of each session, each on its own model: a switch before every model
        core.scheduler.force_switch(f.name)
        turn1[f.name] = run(core, [InstanceCall(f"{f.name}-1", f.name, tuple(prompts[f.name]), GREEDY)])
    assert core.stats().switches == len(files) - 1  # the first model was open from the start
    for f in files:  # the tool gap is over: each session returns while another model holds the arena
        cont = prompts[f.name] + tokens(turn1[f.name][f"{f.name}-1"]) + [1, 2, 3]
        core.scheduler.force_switch(f.name)
        out = run(core, [InstanceCall(f"{f.name}-2", f.name, tuple(cont), GREEDY)])[f"{f.name}-2"]
        usage = out[-1].usage
        committed = len(prompts[f.name]) + GREEDY.max_tokens - 1  # the last sampled token has no KV
        assert usage.restored_tokens == committed // 4 * 4, "the continuation must come from host memory"
        assert usage.cached_tokens == usage.restored_tokens
        assert tokens(out) == refs[f.name].greedy(cont, GREEDY.max_tokens), f.name
    last = core.stats().last_switch
    assert last["path"] in ("full_d2d", "partial", "h2d_only") and len(last["ranks"]) == 1
    events = core.scheduler.drain_events()
    kinds = [e.kind.value for e in events]
    assert kinds.count("switch") == core.stats().switches
    restores = [e.data for e in events if e.kind.value == "kv_restore"]
    assert [r["request"] for r in restores] == [f"{f.name}-2" for f in files]  # one per returning session
    assert all(r["tokens"] > 0 for r in restores)
    checkpoints = [e.data for e in events if e.kind.value == "kv_checkpoint"]
    assert checkpoints and all(c["pages_published"] == c["pages_saved"] for c in checkpoints)  # ranks agreed
    assert [e.t for e in events] == sorted(e.t for e in events)


@pytest.mark.parametrize("salt", [None, "team-a|5f1c0b2a"], ids=["unsalted", "salted"])
def test_switches_restore_every_session_from_host_tp2(three, salt):
    """With a tenant's salt too: every rank's ledger hashes from the salted root, so the ranks agree."""
    files, refs = three
    prompts = sessions(files, seed=1)

    async def scenario():
        group = EngineGroup(instance(files, tp=2, **SUBSTRATE), files, threads=1)
        await group.start()
        try:
            async def call(f, rid, prompt):
                outs = [o async for o in group.generate(InstanceCall(rid, f.name, tuple(prompt), GREEDY,
                                                                     cache_salt=salt))]
                return [t for o in outs for t in o.token_ids], outs[-1].usage
            first = {}
            for f in files:
                await group.switch(f.name, 60)
                first[f.name] = (await call(f, f"{f.name}-1", prompts[f.name]))[0]
            results = {}
            for f in files:
                record = await group.switch(f.name, 60)
                assert record is not None and len(record["ranks"]) == 2
                cont = prompts[f.name] + first[f.name] + [4, 5]
                results[f.name] = (cont, *await call(f, f"{f.name}-2", cont))
            return results
        finally:
            await group.stop()

    for name, (cont, toks, usage) in asyncio.run(scenario()).items():
        committed = len(cont) - 2 - 1
        assert usage.restored_tokens == committed // 4 * 4, name
        assert toks == refs[name].greedy(cont, GREEDY.max_tokens), name


def test_telemetry_reports_where_each_sessions_kv_lives(three):
    files, _ = three
    core = engine(files[:2], **SUBSTRATE)
    a, b = files[0].name, files[1].name
    prompt = tuple(range(30))
    run(core, [InstanceCall("s1", a, prompt, GREEDY, session_id="sess-a")])
    where = {s["session"]: s for s in core.stats().sessions}
    assert where["sess-a"]["location"] == "device" and where["sess-a"]["kv_tokens"] == 36
    core.scheduler.force_switch(b)
    run(core, [InstanceCall("s2", b, prompt, GREEDY, session_id="sess-b")])
    where = {s["session"]: s for s in core.stats().sessions}
    assert where["sess-a"]["location"] == "host" and where["sess-a"]["host_tokens"] == 36  # switched out
    assert where["sess-b"]["location"] == "device"


def test_staging_target_is_the_next_model_in_slot_order_or_set_explicitly(three):
    files, refs = three
    core = engine(files, **SUBSTRATE)  # llama active; slot order llama -> qwen2 -> qwen3
    stager = core.scheduler.memory.stager
    assert stager.target_model == files[1].name
    core.scheduler.stage_next(files[2].name)
    assert stager.target_model == files[2].name
    prompt = list(range(40))
    run(core, [InstanceCall("busy", files[0].name, tuple(prompt), GREEDY)])  # staging advances while it serves
    assert stager.coverage() > 0
    core.scheduler.force_switch(files[2].name)
    out = run(core, [InstanceCall("q3", files[2].name, tuple(prompt), GREEDY)])["q3"]
    assert core.stats().last_switch["path"] in ("full_d2d", "partial")  # some of it came device-to-device
    assert tokens(out) == refs[files[2].name].greedy(prompt, GREEDY.max_tokens)


def test_a_salted_prefix_is_shared_only_with_calls_of_the_same_salt(three):
    """Tenants (and `cache_salt`) never hit each other's cached pages; each hits its own; tokens
    equal the reference either way."""
    files, refs = three
    core = engine(files[:1], **SUBSTRATE)
    name, prompt = files[0].name, tuple(range(3, 40))

    def cached(rid: str, salt: str | None) -> int:
        out = run(core, [InstanceCall(rid, name, prompt, GREEDY, cache_salt=salt)])[rid]
        assert tokens(out) == refs[name].greedy(list(prompt), GREEDY.max_tokens)
        return out[-1].usage.cached_tokens

    full = (len(prompt) - 1) // 4 * 4  # every full page but the one holding the last prompt token
    assert cached("a1", "team-a") == 0
    assert cached("b1", "team-b") == 0  # the same prompt, another tenant: no hit
    assert cached("n1", None) == 0  # nor for the unsalted default tenant
    assert (cached("a2", "team-a"), cached("b2", "team-b"), cached("n2", None)) == (full, full, full)
