"""One rank of an engine group: the memory substrate and, on rank 0, the scheduler and sampler.

Rank 0 calls `step()`: plan, broadcast the plan, run it (memory ops, forward, host-save agreement,
staging), sample, commit. Other ranks call `follow()` in a loop: receive the plan, do the same on
their shard. TP=1 needs no broadcast, so tests and benchmarks drive an EngineCore in-process with
exactly the code a worker process runs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from talaria.config.schema import Ablation, InstanceConfig, Pool
from talaria.contracts.call import CallOutput, InstanceCall, InstanceStats
from talaria.contracts.profile import Profile, load_profile
from talaria.contracts.step_plan import MemoryOps, StepPlan, StopPlan, SwitchPlan
from talaria.executor.arena import ALIGN
from talaria.executor.calibrate import QUICK, Probes, cached_calibration, calibrate
from talaria.executor.parallel import TPGroup
from talaria.executor.runner import run_step
from talaria.executor.sampler import Sampler
from talaria.executor.substrate import Substrate
from talaria.instance.batcher import Batcher
from talaria.instance.cost_model import CostModel
from talaria.instance.memory_planner import MemoryPlanner, full_h2d
from talaria.instance.round_scheduler import RoundConfig, RoundScheduler
from talaria.instance.scheduler import Scheduler
from talaria.memory.host_kv_registry import HostKVRegistry, RankReport
from talaria.memory.page_manager import PageManager
from talaria.memory.rank_ledger import RankLedger, TestOnlyFault
from talaria.memory.stager import Stager
from talaria.memory.switch_record import SwitchRecord
from talaria.models.source import ModelFiles


class EngineCore:
    def __init__(self, instance: InstanceConfig, models: list[ModelFiles], group: TPGroup,
                 clock: Callable[[], float] = time.monotonic, fault: TestOnlyFault | None = None,
                 probes: Probes | None = None) -> None:
        """probes: calibrate with these at start even when the config names a profile (`talaria profile`)."""
        self.instance = instance
        self.group = group
        self.substrate = sub = Substrate(instance, models, group)
        for m in models:  # every model must fit the arena: fail at start, not at its first switch
            sub.layout.plan(m.name)
        self.ledger = RankLedger(group.rank, instance.page_size, fault)
        self.scheduler: Scheduler | None = None
        self.sampler: Sampler | None = None
        self.profile: Profile | None = None
        first = models[0].name
        opening = SwitchPlan(first, full_h2d(sub.images[first].nbytes))
        sub.activate(first, opening.gather, lambda: None)
        if group.rank == 0:
            # cold pools budget their rounds from predicted costs; the router ranks every instance by them
            rounds = instance.pool is Pool.COLD or len(models) > 1
            if probes is not None:
                self.profile = calibrate(self, probes, method="talaria profile", progress=self._progress)
            elif instance.profile:
                self.profile = load_profile(instance.profile)
            else:
                self.profile = cached_calibration(self, Probes() if rounds else QUICK)
            missing = [m.name for m in models if m.name not in self.profile.models]
            if missing:
                raise ValueError(f"profile {instance.profile} has no costs for {', '.join(missing)}; run "
                                 f"`talaria profile` for this config, or drop `profile` to measure at start-up")
            self.scheduler = self._scheduler(models, clock)
            self.scheduler.switched(opening, None, [])
            self.sampler = Sampler()

    def _scheduler(self, models: list[ModelFiles], clock: Callable[[], float]) -> Scheduler:
        inst, sub, ps = self.instance, self.substrate, self.instance.page_size
        host = HostKVRegistry(sub.num_slabs, sub.slab_bytes) if sub.num_slabs and inst.enabled(Ablation.HKVR) \
            else None
        stager = Stager(inst.staging_chunk_bytes, ALIGN) \
            if inst.enabled(Ablation.STAGING) and len(models) > 1 else None
        memory = MemoryPlanner(sub.layout, {n: img.nbytes for n, img in sub.images.items()}, ps, host, stager,
                               inst.debug_poison, sub.save_done, sub.staging_done, sub.wait_save, sub.wait_staging)
        batchers = {m.name: Batcher(m.name, PageManager(sub.layout.plan(m.name).num_pages, ps),
                                    inst.max_batch_tokens, inst.max_running, m.arch.max_position,
                                    m.arch.eos_token_ids, host) for m in models}
        rounds = None
        if inst.pool is Pool.COLD or len(models) > 1:
            config = RoundConfig(inst.ttft_s, inst.tpot_s, inst.gamma, inst.enabled(Ablation.SP), inst.slot_order,
                                 inst.slot_length, inst.max_batch_tokens)
            costs = CostModel(self.profile)

            def rounds(batchers, clock, emit, switch_path, known):
                return RoundScheduler(batchers, costs, clock, config, emit, switch_path, known, ps)
        return Scheduler(inst.name, batchers, clock, memory, rounds, version_base=time.time_ns() // 1000,
                         record_steps=inst.record_steps)

    def _progress(self, line: str) -> None:
        """`talaria profile`: the worker shares the command's stderr."""
        print(f"talaria: {self.instance.name}: {line}", file=sys.stderr, flush=True)

    @property
    def pages(self) -> int:
        """KV pages of the active model's pool."""
        return self.substrate.plan.num_pages

    # ---- rank 0 ----------------------------------------------------------------------------

    def add(self, call: InstanceCall) -> list[CallOutput]:
        return self._forget_finished(self.scheduler.add(call))

    def cancel(self, request_id: str) -> list[CallOutput]:
        return self._forget_finished(self.scheduler.cancel(request_id))

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[CallOutput]:
        plan = self.scheduler.plan()
        if plan is None:
            return []
        t0 = time.perf_counter()
        self.group.broadcast_object(plan)
        if isinstance(plan, SwitchPlan):
            record, reports = self._switch(plan)
            self.scheduler.switched(plan, record, reports)
            return []
        logits, reports = self._run(plan)
        sampled: dict[int, int] = {}
        if logits is not None:
            chunks = [c for c in plan.chunks if c.sample]
            calls = [self.scheduler.call_of(c.seq_id) for c in chunks]
            tokens = self.sampler.sample(logits, [(c.request_id, c.sampling) for c in calls])
            sampled = {c.seq_id: t for c, t in zip(chunks, tokens)}
        return self._forget_finished(self.scheduler.commit(plan, sampled, time.perf_counter() - t0, reports))

    def stop(self) -> None:
        self.group.broadcast_object(StopPlan())

    def stats(self) -> InstanceStats:
        return self.scheduler.stats()

    def _forget_finished(self, outputs: list[CallOutput]) -> list[CallOutput]:
        for out in outputs:
            if out.finish is not None:
                self.sampler.forget(out.request_id)
        return outputs

    # ---- every rank ------------------------------------------------------------------------

    def follow(self) -> bool:
        """Run the next plan rank 0 broadcasts; False when it says stop."""
        plan = self.group.broadcast_object()
        if isinstance(plan, StopPlan):
            return False
        if isinstance(plan, SwitchPlan):
            self._switch(plan)
        else:
            self._run(plan)
        return True

    def _run(self, plan: StepPlan) -> tuple[torch.Tensor | None, list[list[RankReport]] | None]:
        ops = plan.ops or MemoryOps()
        sub = self.substrate
        sub.before_step(ops)
        if ops.stage is not None:  # beside the forward: its pages are blocked from allocation
            model, src0, src1, dst0, dst1 = ops.stage
            sub.start_staging(model, (src0, src1), (dst0, dst1))
        for c in plan.chunks:
            self.ledger.record(c.seq_id, c.start_pos, c.token_ids, c.prefix)
        logits = run_step(sub.model, sub.kv, plan) if plan.chunks else None
        reports = self._agree(ops.agree)
        for seq_id in ops.forget:
            self.ledger.forget(seq_id)
        return logits, reports

    def _agree(self, agree: tuple[tuple[int, int], ...]) -> list[list[RankReport]] | None:
        """Every rank reports, from its own ledger, what it holds of each saved prefix (App. B)."""
        if not agree:
            return None
        mine = []
        for ticket, seq_id in agree:
            self.substrate.wait_save(ticket)
            mine.append(self.ledger.report(seq_id))
        return self.group.gather_objects(mine)

    def _switch(self, plan: SwitchPlan) -> tuple[SwitchRecord | None, list[list[RankReport]] | None]:
        reports = None

        def teardown() -> None:
            nonlocal reports
            self.substrate.before_step(MemoryOps(saves=plan.ops.saves))
            reports = self._agree(plan.ops.agree)
        record = self.substrate.activate(plan.model, plan.gather, teardown)
        records = self.group.gather_objects(record)
        return (SwitchRecord(tuple(records)) if records else None), reports
