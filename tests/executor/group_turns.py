"""Two turns of one session per model through a real engine group (worker processes over gloo):
the scenario the family equivalence tests run at TP > 1."""

from __future__ import annotations

import asyncio

from talaria.config.schema import InstanceConfig
from talaria.contracts.call import InstanceCall
from talaria.models.source import ModelFiles
from talaria.node.engine_group import EngineGroup
from tests.tiny_models import GREEDY


def group_turns(config: InstanceConfig, files: list[ModelFiles], first: dict[str, list[int]],
                beside: dict[str, list[int]], tail: list[int]) -> dict:
    """For each model in turn: a switch to it, turn 1 (`first[name]`) batched with a second call
    (`beside[name]`); then for each again: a switch to it and turn 2 (turn 1, its answer and `tail`),
    after every other model had the arena. Returns {(name, turn): (prompt, tokens, usage)}, turn 0
    being the call beside turn 1."""

    async def scenario() -> dict:
        group = EngineGroup(config, files, threads=1)
        await group.start()
        try:
            async def call(f, rid, prompt):
                outs = [o async for o in group.generate(InstanceCall(rid, f.name, tuple(prompt), GREEDY))]
                return prompt, [t for o in outs for t in o.token_ids], outs[-1].usage
            results = {}
            for f in files:
                await group.switch(f.name, 60)
                results[f.name, 1], results[f.name, 0] = await asyncio.gather(
                    call(f, f"{f.name}-1", first[f.name]), call(f, f"{f.name}-x", beside[f.name]))
            for f in files:
                await group.switch(f.name, 60)
                results[f.name, 2] = await call(f, f"{f.name}-2", first[f.name] + results[f.name, 1][1] + tail)
            return results
        finally:
            await group.stop()

    return asyncio.run(scenario())
