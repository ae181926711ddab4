"""Tensor parallelism over real torch.distributed (gloo) worker processes: an engine group of tp
ranks gives the same greedy tokens as the plain reference, KV heads split (tp 2) or replicated
(tp 4 > 2 KV heads), with batching, chunked prefill and prefix hits in the mix."""

from __future__ import annotations

import asyncio
import random

import pytest

from talaria.contracts.call import InstanceCall
from talaria.node.engine_group import EngineGroup
from tests.executor.reference import ReferenceLlama
from tests.tiny_models import GREEDY, instance, tiny_files


async def _serve(group: EngineGroup, calls: list[InstanceCall]) -> dict[str, list[int]]:
    async def one(c: InstanceCall):
        toks = []
        async for out in group.generate(c):
            toks.extend(out.token_ids)
        return c.request_id, toks

    await group.start()
    try:
        return dict(await asyncio.gather(*(one(c) for c in calls)))
    finally:
        await group.stop()


@pytest.mark.parametrize("tp,families", [(2, ("llama", "qwen2", "qwen3")), (4, ("llama",))])
def test_tp_group_equals_reference(model_cache, tp, families):
    files = [tiny_files(f, model_cache) for f in families]
    rng = random.Random(tp)
    shared = [rng.randrange(256) for _ in range(12)]
    prompts = [shared + [rng.randrange(256) for _ in range(n)] for n in (1, 9, 40)]
    calls = [InstanceCall(f"{m.name}-{i}", m.name, tuple(p), GREEDY)
             for m in files for i, p in enumerate(prompts)]
    group = EngineGroup(instance(files, tp=tp, max_batch_tokens=16), files, threads=1)
    got = asyncio.run(_serve(group, calls))
    for m in files:
        ref = ReferenceLlama(m.directory)
        for i, p in enumerate(prompts):
            assert got[f"{m.name}-{i}"] == ref.greedy(p, GREEDY.max_tokens), f"{m.name} prompt {i} tp={tp}"
