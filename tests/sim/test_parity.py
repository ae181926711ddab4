"""Deterministic parity (the simulator issue): a live cold instance — two models, TP=2 over gloo,
HKVR and staging on — serves agent sessions with `record_steps` on; the simulator, fed the
recorded arrival times and measured step times from the event log (and the tokens the live run
generated), must make the same SP admissions and parkings, switches with the same paths, the same
host restores and the same rounds. The workload is built so each kind of decision happens."""

from __future__ import annotations

import asyncio
import random

import pytest

from talaria.config.schema import Pool
from talaria.contracts.call import InstanceCall, SamplingParams
from talaria.contracts.events import EventKind
from talaria.executor.substrate import runtime_bytes
from talaria.node.engine_group import EngineGroup
from talaria.sim.parity import decisions, outputs_of, replay
from tests.tiny_models import instance, tiny_files

pytestmark = pytest.mark.slow

CONFIG = {"pool": Pool.COLD, "tp": 2, "page_size": 4, "max_batch_tokens": 64, "host_kv_bytes": 8 << 20,
          "staging_chunk_bytes": 16 << 10, "ttft_s": 0.5, "tpot_s": 0.1, "gamma": 0.8, "record_steps": True}


def sampling(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def session(group: EngineGroup, model: str, sid: str, turns: int, tokens: int, rng: random.Random,
                  calls: list, outputs: list) -> None:
    """An agent: each prompt is the previous one, its output and a tool result; a short tool gap."""
    prompt = [rng.randrange(3, 250) for _ in range(rng.randrange(20, 40))]
    for turn in range(turns):
        call = InstanceCall(f"{sid}-{turn}", model, tuple(prompt), sampling(tokens), sid)
        calls.append(call)
        outs = [o async for o in group.generate(call)]
        outputs.extend(outs)
        prompt = prompt + [t for o in outs for t in o.token_ids] + [rng.randrange(3, 250) for _ in range(6)]
        await asyncio.sleep(rng.uniform(0.005, 0.03))


def test_the_simulator_replays_a_live_run_with_the_same_decisions(model_cache):
    files = [tiny_files("llama", model_cache), tiny_files("qwen3", model_cache)]
    config = instance(files, **CONFIG)
    calls: list[InstanceCall] = []
    outputs: list = []
    events: list = []

    async def scenario():
        group = EngineGroup(config, files, threads=1, on_events=events.extend)
        await group.start()
        try:
            rng = random.Random(7)
            agents = [session(group, f.name, f"{f.name}-anchor", 2, 40, rng, calls, outputs) for f in files]
            agents += [session(group, f.name, f"{f.name}-s{i}", 4, 3, rng, calls, outputs)
                       for f in files for i in range(2)]
            await asyncio.gather(*agents)
            return group.ready.profile
        finally:
            await group.stop()

    profile = asyncio.run(scenario())
    live = decisions(events, config.name)
    assert live["sp_admit"] and len(live["switch"]) >= 2 and live["kv_restore"], \
        f"the workload must exercise SP, switches and host restores: {live}"
    simulated = replay(config, profile, events, calls, outputs_of(outputs), sum(runtime_bytes(f) for f in files))
    sim = decisions(simulated, config.name)
    for kind in live:
        assert sim[kind] == live[kind], kind
    # each step record carries the profile's price of its plan (what bench/sp.py fits live steps against):
    # the same plans, so the same prices in both runs, and every part occurs
    priced_live, priced_sim = priced_steps(events, config.name), priced_steps(simulated, config.name)
    assert priced_live == priced_sim
    assert all(any(part > 0 for part in parts) for parts in zip(*priced_live))  # prompt, restore and decode parts


def priced_steps(events, instance: str) -> list[tuple[float, float, float]]:
    return [(e.data["priced_prefill_s"], e.data["priced_restore_s"], e.data["priced_decode_s"]) for e in events
            if e.instance == instance and e.kind is EventKind.STEP and not e.data.get("switch")]
