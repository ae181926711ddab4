"""One instance in virtual time: the live node's scheduler and memory bookkeeping, no tensors.

A `SimInstance` gets its policy objects from the same assembly as the live rank 0
(talaria/instance/assembly.py) — a `Scheduler` over `Batcher`s, a `MemoryPlanner` over `BumpLayout`,
`HostKVRegistry` and `Stager`, and for cold pools the `RoundScheduler` — from the instance's config
and the profile's model sizes (each model's cache layout rebuilt from them, `ModelProfile.layout`,
so the arena is laid out as the engine's). Where the engine would
run a step, the simulator charges its cost from the profile and commits it when the virtual clock
gets there; one `RankLedger` stands in for the ranks' KV (they agree by construction). D2H saves
and staging copies finish after their bytes / bandwidth, checked when the planner asks, as the
engine's copy events are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from talaria.config.schema import InstanceConfig
from talaria.contracts.call import CallOutput, InstanceCall
from talaria.contracts.profile import Profile
from talaria.contracts.step_plan import MemoryOps, StepPlan, SwitchPlan
from talaria.instance.assembly import ServedModel, assemble
from talaria.memory.bump_layout import ALIGN, BumpLayout
from talaria.memory.rank_ledger import RankLedger
from talaria.memory.switch_record import RankSwitchRecord, SwitchRecord
from talaria.sim.loop import EventLoop

RUNTIME_BYTES = 1 << 30  # per rank at most: attention workspace, graphs; small arenas (CPU) get 1/64 of it
IDLE_RETRY_S = 0.001  # work that cannot move yet (KV pinned by a save in flight) is retried this soon
MAX_CONTEXT = 1 << 20  # tokens; the trace, not the model card, bounds a simulated call


class SimInstance:
    def __init__(self, config: InstanceConfig, profile: Profile, loop: EventLoop,
                 on_outputs: Callable[[SimInstance, list[CallOutput]], None],
                 on_events: Callable[[list], None], runtime_bytes: int | None = None,
                 learn: bool = False, slowdown: tuple[float, float] | None = None) -> None:
        """`runtime_bytes`: the arena's runtime region (default: a GPU-sized guess, at most 1/64 of
        the arena). `learn`: the round scheduler's cost model learns from step times, as live;
        off, it charges the profile exactly (its step times are the profile's anyway). `slowdown`:
        (from, factor): from virtual time `from` on, every step takes `factor` x its price."""
        self.config = config
        self.name = config.name
        self.profile = profile
        self.loop = loop
        self.clock = loop.clock
        self._on_outputs = on_outputs
        self._on_events = on_events
        ps = config.page_size
        models = list(config.models)
        self.runtime_bytes = runtime_bytes if runtime_bytes is not None else \
            min(RUNTIME_BYTES, config.arena_bytes // 64) // ALIGN * ALIGN
        self.layout = BumpLayout(config.arena_bytes, self.runtime_bytes, ALIGN)
        served = []
        for m in models:
            mp = profile.model(m)
            kv = mp.layout(ps)
            self.layout.register(m, mp.weights_bytes, kv, kv.state_slots(config.max_running))
            served.append(ServedModel(m, mp.weights_bytes, kv, MAX_CONTEXT, ()))
        self._copies: dict[int, float] = {}  # save ticket -> when its D2H copies finish
        self._staging_until = 0.0
        # no bytes move here, so nothing is poisoned (the poison pages would only add empty steps)
        self.scheduler = assemble(replace(config, debug_poison=False), self.layout, served, profile, self, self.clock,
                                  learn=learn)
        self.memory = self.scheduler.memory
        self.ledger = RankLedger(0, ps)
        self.busy = False
        self.slowdown = slowdown
        self.hbm_peak_bytes = 0
        self._hbm_fixed: dict[str, tuple[int, int]] = {}  # model -> (weights + states + runtime bytes, page bytes)

    # ---- calls in ---------------------------------------------------------------------------

    def add(self, call: InstanceCall) -> None:
        outputs = self.scheduler.add(call)
        if outputs:
            self._on_outputs(self, outputs)
        self.kick()

    def kick(self) -> None:
        """Start stepping if idle."""
        if not self.busy:
            self.busy = True
            self.loop.after(0.0, self._step)

    # ---- one step ---------------------------------------------------------------------------

    def _step(self) -> None:
        if not self.scheduler.has_work:
            self.busy = False
            return
        plan = self.scheduler.plan()
        self._drain()
        if plan is None:
            self.loop.after(IDLE_RETRY_S, self._step)
            return
        if isinstance(plan, SwitchPlan):
            record, seconds = self._switch_record(plan)
            self.loop.after(seconds, lambda: self._switched(plan, record))
            return
        seconds = self.step_cost(plan)
        ops = plan.ops or MemoryOps()
        now = self.clock()
        for save in ops.saves:  # D2H beside the step: done after its pages and states at the host link's rate
            tokens = len(save.copies) * self.memory.page_size
            self._copies[save.ticket] = now + self.profile.save_s(plan.model, tokens, len(save.states))
        if ops.stage is not None:
            _, src0, src1, _, _ = ops.stage
            self._staging_until = now + (src1 - src0) / self.profile.bandwidth.h2d_bytes_per_s
        seconds = max(seconds, IDLE_RETRY_S if not plan.chunks else 0.0)
        self.loop.after(seconds, lambda: self._commit(plan, seconds))

    def step_cost(self, plan: StepPlan) -> float:
        """Seconds of one engine step: the profile's price for it (`Profile.step_s`), which is what the
        scheduler predicted for it too (times the slowdown, once it applies)."""
        seconds = self.profile.step_s(plan, self.memory.page_size)
        if self.slowdown is not None and self.clock() >= self.slowdown[0]:
            seconds *= self.slowdown[1]
        return seconds

    def _commit(self, plan: StepPlan, seconds: float) -> None:
        ops = plan.ops or MemoryOps()
        for c in plan.chunks:
            self.ledger.record(c.seq_id, c.start_pos, c.token_ids, c.prefix)
        reports = [[self.ledger.report(seq_id) for _, seq_id in ops.agree]] if ops.agree else None
        sampled = {c.seq_id: self._token(c) for c in plan.chunks if c.sample}
        outputs = self.scheduler.commit(plan, sampled, seconds, reports)
        for seq_id in ops.forget:
            self.ledger.forget(seq_id)
        self._note_hbm(plan.model)
        self._drain()
        if outputs:
            self._on_outputs(self, outputs)
        self.loop.after(0.0, self._step)

    def _token(self, chunk) -> int:
        """The token a sampling step draws: a fixed function of the position, so output is reproducible."""
        return (chunk.context_len * 2654435761 + chunk.seq_id) % 251 + 3

    def _switch_record(self, plan: SwitchPlan) -> tuple[SwitchRecord, float]:
        """The switch's five phases as the profile prices them at the coverage its gather plan has."""
        g = plan.gather
        phases = self.profile.switch_phases(plan.model, g.staged_bytes / g.total_bytes)
        rank = RankSwitchRecord(0, self.scheduler.active, plan.model, g.path, tuple(p * 1000 for p in phases),
                                g.staged_bytes, g.dirty_bytes, g.total_bytes, False)
        return SwitchRecord((rank,)), sum(phases)

    def _switched(self, plan: SwitchPlan, record: SwitchRecord) -> None:
        reports = [[self.ledger.report(seq_id) for _, seq_id in plan.ops.agree]]
        self.scheduler.switched(plan, record, reports)
        self._drain()
        self.loop.after(0.0, self._step)

    # ---- the planner's copy events (CopyEvents), in virtual time ----------------------------------

    def save_done(self, ticket: int) -> bool:
        return self.clock() >= self._copies.get(ticket, 0.0)

    def wait_save(self, ticket: int) -> None:
        """No blocking in virtual time: a step with nothing but copies to wait for is retried after
        IDLE_RETRY_S, and the planner finds them done once the clock passes their end."""

    def staging_done(self) -> bool:
        return self.clock() >= self._staging_until

    def wait_staging(self) -> None:
        """No blocking in virtual time: a chunk still in flight at a switch counts as written."""

    # ---- reporting --------------------------------------------------------------------------

    def _drain(self) -> None:
        events = self.scheduler.drain_events()
        if events:
            self._on_events(events)

    def _note_hbm(self, model: str) -> None:
        fixed = self._hbm_fixed.get(model)
        if fixed is None:  # the layout is fixed at start: work its plan out once per model
            plan = self.layout.plan(model)
            fixed = self._hbm_fixed[model] = (plan.weights.size + plan.states.size + self.runtime_bytes,
                                              plan.page_bytes)
        used = fixed[0] + self.scheduler.batchers[model].pages.num_used * fixed[1]
        stager = self.memory.stager
        if stager is not None:  # the next model's chunks in the KV tail hold HBM too (paper §4.4, Fig. 15)
            used += stager.held_bytes()
        self.hbm_peak_bytes = max(self.hbm_peak_bytes, used)
