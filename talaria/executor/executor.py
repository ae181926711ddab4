"""One rank of an engine group: it runs rank 0's plans on its shard of every model.

Every rank holds a `Substrate` (the arena, host weight images, host KV slabs, staging copies) and a
`RankLedger` (what it has written into its KV). Rank 0 decides (talaria/executor/driver.py) and calls
`run` and `switch`, which broadcast the plan and then execute it here; every other rank calls
`follow` in a loop, executing the same plans on its own shard until rank 0 broadcasts a stop. TP=1
needs no broadcast, so tests and benchmarks run an Executor in-process with exactly the code a
worker process runs.
"""

from __future__ import annotations

import torch

from talaria.config.schema import InstanceConfig
from talaria.contracts.step_plan import MemoryOps, StepPlan, StopPlan, SwitchPlan
from talaria.executor.parallel import TPGroup
from talaria.executor.runner import run_step
from talaria.executor.substrate import Substrate
from talaria.instance.assembly import ServedModel
from talaria.instance.memory_planner import full_h2d
from talaria.memory.host_kv_registry import RankReport
from talaria.memory.rank_ledger import RankLedger, TestOnlyFault
from talaria.memory.switch_record import SwitchRecord
from talaria.models.source import ModelFiles

Reports = list[list[RankReport]]  # per rank, one report per agreed save


class Executor:
    def __init__(self, instance: InstanceConfig, models: list[ModelFiles], group: TPGroup,
                 fault: TestOnlyFault | None = None) -> None:
        """Load every model's shard into host images and open the first; `fault`: tests only."""
        self.instance = instance
        self.group = group
        self.substrate = sub = Substrate(instance, models, group)
        for m in models:  # every model must fit the arena: fail at start, not at its first switch
            sub.layout.plan(m.name)
        self.ledger = RankLedger(group.rank, instance.page_size, fault)
        first = models[0].name
        sub.activate(first, full_h2d(sub.images[first].nbytes), lambda: None)

    @property
    def pages(self) -> int:
        """KV pages of the active model's pool."""
        return self.substrate.plan.num_pages

    def served_models(self) -> list[ServedModel]:
        """What the instance's policy needs to know of each model, from this rank's shard."""
        return [ServedModel(name, img.nbytes, img.layout, img.files.arch.max_position,
                            img.files.arch.eos_token_ids) for name, img in self.substrate.images.items()]

    # ---- rank 0 ----------------------------------------------------------------------------

    def run(self, plan: StepPlan) -> tuple[torch.Tensor | None, Reports | None]:
        """Every rank runs `plan`: memory ops, the forward, the host-save agreement. Rank 0 gets the
        logits of the chunks that sample and every rank's save reports."""
        self.group.broadcast_object(plan)
        return self._run(plan)

    def switch(self, plan: SwitchPlan) -> tuple[SwitchRecord | None, Reports | None]:
        """Every rank opens `plan.model`; rank 0 gets every rank's record and save reports."""
        self.group.broadcast_object(plan)
        return self._switch(plan)

    def stop(self) -> None:
        """Tell every other rank to leave `follow`."""
        self.group.broadcast_object(StopPlan())

    def keepalive(self) -> None:
        """An idle rank 0's no-op plan: the other ranks' wait for a plan restarts its timeout."""
        self.group.broadcast_object(None)

    # ---- every other rank ------------------------------------------------------------------

    def follow(self) -> bool:
        """Run the next plan rank 0 broadcasts; False when it says stop."""
        plan = self.group.broadcast_object()
        if plan is None:  # keep-alive
            return True
        if isinstance(plan, StopPlan):
            return False
        if isinstance(plan, SwitchPlan):
            self._switch(plan)
        else:
            self._run(plan)
        return True

    # ---- every rank ------------------------------------------------------------------------

    def _run(self, plan: StepPlan) -> tuple[torch.Tensor | None, Reports | None]:
        ops = plan.ops or MemoryOps()
        sub = self.substrate
        sub.before_step(ops)
        if ops.stage is not None:  # beside the forward: its pages are blocked from allocation
            model, src0, src1, dst0, dst1 = ops.stage
            sub.start_staging(model, (src0, src1), (dst0, dst1))
        for c in plan.chunks:
            self.ledger.record(c.seq_id, c.start_pos, c.token_ids, c.prefix, c.root)
        logits = run_step(sub.model, sub.kv, plan) if plan.chunks else None
        reports = self._agree(ops.agree)
        for seq_id in ops.forget:
            self.ledger.forget(seq_id)
        return logits, reports

    def _agree(self, agree: tuple[tuple[int, int], ...]) -> Reports | None:
        """Every rank reports, from its own ledger, what it holds of each saved prefix (App. B)."""
        if not agree:
            return None
        mine = []
        for ticket, seq_id in agree:
            self.substrate.wait_save(ticket)
            mine.append(self.ledger.report(seq_id))
        return self.group.gather_objects(mine)

    def _switch(self, plan: SwitchPlan) -> tuple[SwitchRecord | None, Reports | None]:
        reports = None

        def teardown() -> None:
            nonlocal reports
            self.substrate.before_step(MemoryOps(state_copies=plan.ops.state_copies, saves=plan.ops.saves))
            reports = self._agree(plan.ops.agree)
        record = self.substrate.activate(plan.model, plan.gather, teardown)
        records = self.group.gather_objects(record)
        return (SwitchRecord(tuple(records)) if records else None), reports
