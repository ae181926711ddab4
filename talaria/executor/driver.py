"""Rank 0 of an engine group: the instance's scheduler and sampler driving the executor.

`start_driver` gives the instance its cost profile (the config's file, a start-up calibration cached
per machine, or the probes `talaria profile` asks for), builds its policy objects with the one
assembly (talaria/instance/assembly.py) and returns a `Driver`. Each `step` is: plan, run the plan
on every rank, sample the chunks that sample, commit — the rank loop and in-process tests call it
alike.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from talaria.config.schema import Pool
from talaria.contracts.call import CallOutput, InstanceCall, InstanceStats
from talaria.contracts.profile import Profile
from talaria.contracts.profile_file import load_profile
from talaria.contracts.step_plan import SwitchPlan
from talaria.executor.calibrate import cached_calibration, calibrate
from talaria.executor.executor import Executor
from talaria.executor.grammar_masks import GrammarMasks
from talaria.executor.probes import FULL, QUICK, Probes
from talaria.executor.sampler import Sampler
from talaria.instance.assembly import assemble
from talaria.instance.scheduler import Scheduler


class Driver:
    def __init__(self, executor: Executor, scheduler: Scheduler, profile: Profile) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.profile = profile  # the costs it runs on: the router's cost model too
        self.sampler = Sampler(GrammarMasks({n: img.files for n, img in executor.substrate.images.items()}))

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add(self, call: InstanceCall) -> list[CallOutput]:
        return self._forget_finished(self.scheduler.add(call))

    def cancel(self, request_id: str) -> list[CallOutput]:
        return self._forget_finished(self.scheduler.cancel(request_id))

    def step(self) -> list[CallOutput]:
        """Plan the next step or switch and run it on every rank; the outputs it produced."""
        plan = self.scheduler.plan()
        if plan is None:
            return []
        t0 = time.perf_counter()
        if isinstance(plan, SwitchPlan):
            record, reports = self.executor.switch(plan)
            self.scheduler.switched(plan, record, reports)
            return []
        logits, reports = self.executor.run(plan)
        sampled: dict[int, int] = {}
        failed: dict[str, str] = {}
        if logits is not None:
            chunks = [c for c in plan.chunks if c.sample]
            calls = [self.scheduler.call_of(c.seq_id) for c in chunks]
            tokens, failed = self.sampler.sample(logits, [(c.request_id, c.sampling) for c in calls], plan.model)
            sampled = {c.seq_id: t for c, t in zip(chunks, tokens)}
        outputs = self.scheduler.commit(plan, sampled, time.perf_counter() - t0, reports)
        for request_id, why in failed.items():  # one call's grammar fails that call, not the step
            outputs += self.scheduler.fail(request_id, why)
        return self._forget_finished(outputs)

    def stats(self) -> InstanceStats:
        return self.scheduler.stats()

    def stop(self) -> None:
        self.executor.stop()

    def _forget_finished(self, outputs: list[CallOutput]) -> list[CallOutput]:
        for out in outputs:
            if out.finish is not None:
                self.sampler.forget(out.request_id)
        return outputs


def start_driver(executor: Executor, clock: Callable[[], float] = time.monotonic,
                 probes: Probes | None = None) -> Driver:
    """Rank 0, with every other rank in `follow`: the profile, then the policy, then the Driver.

    `probes`: calibrate with these whatever the config says (`talaria profile`). Otherwise the
    config's profile file, or a start-up calibration (cached per machine and shape): the full probe
    set where rounds are budgeted from it, the quick one on a hot instance, which only the router's
    ranking reads."""
    inst = executor.instance
    names = list(executor.substrate.images)
    rounds = inst.pool is Pool.COLD or len(names) > 1
    if probes is not None:
        profile = calibrate(executor, probes, method="talaria profile", progress=_progress(inst.name))
    elif inst.profile:
        profile = load_profile(inst.profile)
    else:
        profile = cached_calibration(executor, FULL if rounds else QUICK)
    missing = [n for n in names if n not in profile.models]
    if missing:
        raise ValueError(f"profile {inst.profile} has no costs for {', '.join(missing)}; run "
                         f"`talaria profile` for this config, or drop `profile` to measure at start-up")
    scheduler = assemble(inst, executor.substrate.layout, executor.served_models(), profile, executor.substrate,
                         clock, version_base=time.time_ns() // 1000)
    return Driver(executor, scheduler, profile)


def _progress(instance: str) -> Callable[[str], None]:
    """`talaria profile`: the worker shares the command's stderr."""
    return lambda line: print(f"talaria: {instance}: {line}", file=sys.stderr, flush=True)
