"""One instance's policy objects, built in one place for the live rank 0, the simulator and tests.

An instance is a `Scheduler` over one `Batcher` per served model, a `MemoryPlanner` over the bump
layout, the host KV registry and the stager, and on a cold pool (or any instance serving several
models) a `RoundScheduler` that budgets rounds with a `CostModel` over the cost profile. What differs
between the three callers is passed in, not re-assembled: the arena's `BumpLayout` (the substrate's
on the live node, one sized from the profile in the simulator, a toy one in tests), the copy engine's
completion events (`CopyEvents`), the clock, and whether costs learn from measured step times.
The first model is open when this returns, as every caller opens it before anything else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from talaria.config.schema import Ablation, InstanceConfig, Pool
from talaria.contracts.kv_layout import KVLayout
from talaria.contracts.profile import ModelProfile, Profile
from talaria.contracts.step_plan import SwitchPlan
from talaria.instance.batcher import Batcher
from talaria.instance.cost_model import EWMA_ALPHA, CostModel
from talaria.instance.memory_planner import CopyEvents, MemoryPlanner, full_h2d
from talaria.instance.round_scheduler import RoundScheduler
from talaria.instance.rounds import RoundConfig
from talaria.instance.scheduler import Scheduler
from talaria.memory.bump_layout import ALIGN, BumpLayout
from talaria.memory.host_kv_registry import HostKVRegistry, SlabPools
from talaria.memory.page_manager import PageManager
from talaria.memory.stager import Stager


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What an instance's policy needs to know about one model it serves."""

    name: str
    weights_bytes: int  # per rank: the bytes a switch opens
    layout: KVLayout  # its cache on one rank: page and state bytes, the resume rule
    max_context: int  # tokens a sequence may reach, prompt and output together
    eos_token_ids: tuple[int, ...]  # end a sequence (unless the call ignores EOS)

    @property
    def page_bytes(self) -> int:
        """One KV page, per rank; host KV slabs hold the largest model's page."""
        return self.layout.page_bytes


def new_stager(config: InstanceConfig, models: int) -> Stager | None:
    """A stager for an instance of `config` serving `models` models; None when staging is off there.
    Calibration stages with one too, to time the staged switch paths the instance will take."""
    if not config.enabled(Ablation.STAGING) or models < 2:
        return None
    return Stager(config.staging_chunk_bytes, ALIGN)


SNAPSHOT_OVERHEAD = 0.05  # the prefill time that snapshots inside long prompts may add (their extra steps)


def snapshot_spacing(config: InstanceConfig, layout: KVLayout, priced: ModelProfile | None) -> int:
    """Tokens between the state snapshots a stateful model's long prompts take (their chunks end
    there), a multiple of the page size: `snapshot_every_tokens`, or by default the spacing at which
    one more prefill step (its fixed cost) per spacing adds SNAPSHOT_OVERHEAD of the tokens' own
    prefill time by the cost profile; 0 (where chunks end anyway) when neither gives one."""
    ps = config.page_size
    every = config.snapshot_every_tokens
    if not every and priced is not None and priced.prefill.per_token_s > 0:
        every = math.ceil(priced.prefill.base_s / (SNAPSHOT_OVERHEAD * priced.prefill.per_token_s))
    return -(-every // ps) * ps if every else 0


def assemble(config: InstanceConfig, layout: BumpLayout, models: Sequence[ServedModel], profile: Profile,
             copies: CopyEvents, clock: Callable[[], float], *, learn: bool = True, version_base: int = 0,
             rounds: RoundConfig | None = None) -> Scheduler:
    """The instance's `Scheduler`, with the first of `models` open.

    `layout` must have every model registered. `learn`: the cost model folds measured step times in
    (the live node; off, predictions stay the profile's). `version_base`: where snapshot versions
    start (a restarted instance passes its start time, so its snapshots look newer). `rounds`: the
    round configuration, when not the one `config` asks for (tests)."""
    ps = config.page_size
    weights = {m.name: m.weights_bytes for m in models}
    layouts = {m.name: m.layout for m in models}
    pools = SlabPools.of(config.host_kv_bytes, [layout.plan(m.name) for m in models])
    # HKVR ablated, host KV still swaps the sequences a slot's close preempts (host_kv_registry.py)
    host = HostKVRegistry(pools.pages, pools.page_bytes, pools.states, pools.state_bytes, layouts,
                          sessions=config.enabled(Ablation.HKVR)) if pools.pages else None
    stager = new_stager(config, len(models))
    memory = MemoryPlanner(layout, weights, ps, host, stager, config.debug_poison, copies, layouts)
    batchers = {}
    for m in models:
        plan = layout.plan(m.name)
        pages = PageManager(plan.num_pages, ps, layout=m.layout, state_slots=plan.num_state_slots)
        every = snapshot_spacing(config, m.layout, profile.models.get(m.name)) if m.layout.stateful else 0
        batchers[m.name] = Batcher(m.name, pages, config.max_batch_tokens, config.max_running, m.max_context,
                                   m.eos_token_ids, host, every)
    costs = CostModel(profile, ps, alpha=EWMA_ALPHA if learn else 0.0)
    build_rounds = None
    if config.pool is Pool.COLD or len(models) > 1:
        round_config = rounds if rounds is not None else RoundConfig.of(config)

        def build_rounds(batchers, clock, emit, switch_coverage, known):
            return RoundScheduler(batchers, costs, clock, round_config, emit, switch_coverage, known, ps)
    scheduler = Scheduler(config.name, batchers, clock, memory, costs, build_rounds, version_base=version_base,
                          record_steps=config.record_steps)
    first = models[0].name
    scheduler.switched(SwitchPlan(first, full_h2d(weights[first])), None, [])
    return scheduler
