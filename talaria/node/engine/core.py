"""One rank of an engine group: arena, model runners and, on rank 0, the scheduler and sampler.

Rank 0 calls `step()`: plan, broadcast the plan, run it, sample, commit. Other ranks call `follow()`
in a loop: receive the plan, run the same forward on their shard. TP=1 needs no broadcast, so tests
and benchmarks drive an EngineCore in-process with exactly the code a worker process runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from talaria.config.schema import InstanceConfig
from talaria.contracts.call import CallOutput, InstanceCall, InstanceStats
from talaria.models.source import ModelFiles
from talaria.node.batcher import Batcher
from talaria.node.engine.arena import ALIGN, Arena
from talaria.node.engine.parallel import TPGroup
from talaria.node.engine.runner import ModelRunner
from talaria.node.engine.sampler import Sampler
from talaria.node.memory.page_manager import PageManager
from talaria.node.scheduler import Scheduler
from talaria.node.step_plan import StopPlan

MIN_PAGES = 4


class EngineCore:
    def __init__(self, instance: InstanceConfig, models: list[ModelFiles], group: TPGroup,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.instance = instance
        self.group = group
        self.arena = Arena(instance.arena_bytes, instance.device.value)
        self.runners = {m.name: ModelRunner(m, self.arena, group) for m in models}
        # the KV pools share what the weights left, equally by bytes (the memory substrate refines this)
        share = self.arena.free_bytes // len(models)
        self.pages = {}
        for name, runner in self.runners.items():
            n = (share - ALIGN) // runner.page_bytes(instance.page_size) - 1  # the null page, alignment slack
            if n < MIN_PAGES:
                raise MemoryError(f"instance {instance.name}: arena_bytes = {instance.arena_bytes} leaves room "
                                  f"for {max(n, 0)} KV pages of model {name!r}; raise arena_bytes")
            runner.bind_kv(self.arena, n, instance.page_size)
            self.pages[name] = n
        self.scheduler: Scheduler | None = None
        self.sampler: Sampler | None = None
        if group.rank == 0:
            batchers = {m.name: Batcher(m.name, PageManager(self.pages[m.name], instance.page_size),
                                        instance.max_batch_tokens, instance.max_running,
                                        m.arch.max_position, m.arch.eos_token_ids) for m in models}
            self.scheduler = Scheduler(instance.name, batchers, clock)
            self.sampler = Sampler()
        self.clock = clock

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
        logits = self.runners[plan.model].execute(plan)
        sampled: dict[int, int] = {}
        if logits is not None:
            chunks = [c for c in plan.chunks if c.sample]
            calls = [self.scheduler.call_of(c.seq_id) for c in chunks]
            tokens = self.sampler.sample(logits, [(c.request_id, c.sampling) for c in calls])
            sampled = {c.seq_id: t for c, t in zip(chunks, tokens)}
        return self._forget_finished(self.scheduler.commit(plan, sampled, time.perf_counter() - t0))

    def stop(self) -> None:
        self.group.broadcast_object(StopPlan())

    def stats(self) -> InstanceStats:
        return self.scheduler.stats()

    def _forget_finished(self, outputs: list[CallOutput]) -> list[CallOutput]:
        for out in outputs:
            if out.finish is not None:
                self.sampler.forget(out.request_id)
        return outputs

    # ---- ranks > 0 -------------------------------------------------------------------------

    def follow(self) -> bool:
        """Run the next plan rank 0 broadcasts; False when it says stop."""
        plan = self.group.broadcast_object()
        if isinstance(plan, StopPlan):
            return False
        self.runners[plan.model].execute(plan)
        return True
