"""`talaria.sim.instance`: the simulator charges exactly what the live scheduler predicts.

One cost function: a step or switch the round scheduler plans is predicted (its budget) with the
profile's prices, and `SimInstance` charges the resulting plan with the same prices. With learning
off (scales 1) the two must be equal for every plan: batched prefill chunks, cold and after a cached
prefix, host KV restores, decode steps, and switches by every path at the coverage staging reached.
The toy profile has a fixed cost per forward and an attention term, so pricing a chunk alone instead
of inside its batch, or ignoring its cached prefix, would show.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest

from talaria.config.schema import (
    Ablation,
    InstanceConfig,
    ModelConfig,
    Pool,
    TalariaConfig,
)
from talaria.contracts.profile import (
    Bandwidth,
    DecodeCurve,
    ModelProfile,
    PrefillCurve,
    Profile,
    SwitchCost,
)
from talaria.contracts.step_plan import StepPlan, SwitchPlan
from talaria.contracts.trace import TraceCall
from talaria.contracts.vocabulary import SwitchPath
from talaria.memory.bump_layout import ALIGN
from talaria.sim import simulation
from talaria.sim.instance import SimInstance
from talaria.sim.loop import EventLoop, VirtualClock
from talaria.sim.simulation import Simulation

KV_PER_TOKEN = 4096
SWITCHES = {SwitchPath.FULL_D2D: SwitchCost(SwitchPath.FULL_D2D, (0.01, 0.05, 0.002, 0.003, 0.001)),
            SwitchPath.PARTIAL: SwitchCost(SwitchPath.PARTIAL, (0.02, 0.4, 0.002, 0.003, 0.001)),
            SwitchPath.H2D_ONLY: SwitchCost(SwitchPath.H2D_ONLY, (0.03, 0.9, 0.002, 0.003, 0.001))}
PROFILE = Profile("toy", "cpu", 1, 1 << 30, "2026-12-01T00:00:00+00:00", "hand-written for tests",
                  Bandwidth(2e9, 2e9, 2e10),
                  {m: ModelProfile(m, 96 << 20, KV_PER_TOKEN, PrefillCurve(0.004, 2e-5, 3e-9),
                                   DecodeCurve(0.006, 1e-4, 2e-8), SWITCHES) for m in ("m", "n")})
INSTANCE = InstanceConfig("cold-0", Pool.COLD, ("m", "n"), arena_bytes=256 << 20, page_size=16,
                          max_batch_tokens=256, host_kv_bytes=64 << 20, staging_chunk_bytes=4 << 20,
                          ttft_s=2.0, tpot_s=0.1)
CONFIG = TalariaConfig(None, models=(ModelConfig("m", "synthetic:"), ModelConfig("n", "synthetic:")),
                       instances=(INSTANCE,))


class Recording(SimInstance):
    """Records, beside every charge, what the round scheduler predicted for that plan."""

    seen: ClassVar[list[tuple[StepPlan | SwitchPlan, float, float]]] = []

    def step_cost(self, plan: StepPlan) -> float:
        charged = super().step_cost(plan)
        flight = self.scheduler.rounds.in_flight
        if plan.chunks and flight is not None:  # a memory-only step is no decision of the round scheduler
            Recording.seen.append((plan, flight[1], charged))
        return charged

    def _switch_record(self, plan: SwitchPlan):
        record, charged = super()._switch_record(plan)
        Recording.seen.append((plan, self.scheduler.rounds.in_flight[1], charged))
        return record, charged


def agent_trace(sessions: int = 8, calls: int = 6) -> list[TraceCall]:
    """Sessions on both models; every call after the first reuses all but 300 tokens of the last."""
    out = []
    for s in range(sessions):
        prompt = 700 + 90 * s
        for k in range(calls):
            out.append(TraceCall(f"s{s}", k, "m" if s % 2 else "n", prompt, 0 if k == 0 else prompt - 300, 12,
                                 0.05 * s if k == 0 else 0.3))
            prompt += 350
    return out


@pytest.fixture(scope="module")
def recorded() -> list[tuple[StepPlan | SwitchPlan, float, float]]:
    Recording.seen = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(simulation, "SimInstance", Recording)
        result = Simulation(CONFIG, PROFILE, agent_trace()).run()
    assert all(c.done is not None and c.error is None for c in result.calls)
    return Recording.seen


def test_every_step_is_charged_what_the_scheduler_predicted(recorded):
    steps = [(p, predicted, charged) for p, predicted, charged in recorded if isinstance(p, StepPlan)]
    assert steps
    for plan, predicted, charged in steps:
        assert charged == pytest.approx(predicted, rel=1e-9), plan
    prefill = [(p, c) for p, _, _ in steps for c in p.chunks if not c.decode]
    assert any(c.start_pos == 0 for _, c in prefill), "no cold prefill chunk was planned"
    assert any(c.start_pos > 0 and c.prefix for _, c in prefill), "no prefill after a cached prefix was planned"
    assert any(sum(not c.decode for c in p.chunks) > 1 for p, _, _ in steps), "no batched prefill was planned"
    assert any(p.ops is not None and p.ops.restores for p, _, _ in steps), "no host KV restore was planned"
    assert any(all(c.decode for c in p.chunks) for p, _, _ in steps), "no decode step was planned"


def test_every_switch_is_charged_what_the_scheduler_predicted(recorded):
    switches = [(p, predicted, charged) for p, predicted, charged in recorded if isinstance(p, SwitchPlan)]
    for plan, predicted, charged in switches:
        assert charged == pytest.approx(predicted, rel=1e-9), plan.gather
    paths = {p.gather.path for p, _, _ in switches}
    coverages = {round(p.gather.staged_bytes / p.gather.total_bytes, 6) for p, _, _ in switches
                 if p.gather.path is SwitchPath.PARTIAL}
    assert {SwitchPath.FULL_D2D, SwitchPath.PARTIAL} <= paths, f"switch paths seen: {paths}"
    assert len(coverages) >= 2, f"partial switches at coverages {coverages}"  # (H2D opens: the test below)


@pytest.mark.parametrize("chunks", [0, 1, 5, 12, 24])
def test_a_switch_at_any_staging_coverage_is_predicted_as_charged(chunks):
    """Stage `chunks` of n's chunks into m's KV tail, let n's work open its slot, and compare the
    round scheduler's predicted switch with the simulator's charge for the switch plan it makes."""
    loop = EventLoop(VirtualClock())
    inst = SimInstance(INSTANCE, PROFILE, loop, lambda i, o: None, lambda e: None)
    stager = inst.memory.stager
    assert stager.target_model == "n"
    for _ in range(chunks):
        chunk = stager.next_chunk(lambda pages: True)
        if chunk is not None:
            stager.written(chunk)
    inst.add(call_of("n"))
    plan = inst.scheduler.plan()
    assert isinstance(plan, SwitchPlan) and plan.model == "n"
    predicted = inst.scheduler.rounds.in_flight[1]
    coverage = plan.gather.staged_bytes / plan.gather.total_bytes
    assert plan.gather.path is SwitchPath.for_coverage(coverage)
    assert inst._switch_record(plan)[1] == pytest.approx(predicted, rel=1e-12)
    assert predicted == pytest.approx(PROFILE.switch_s("n", coverage), rel=1e-12)


def test_without_staging_every_switch_is_an_h2d_open():
    loop = EventLoop(VirtualClock())
    config = INSTANCE.__class__(**{**{f: getattr(INSTANCE, f) for f in INSTANCE.__dataclass_fields__},
                                   "ablations": (Ablation.STAGING,)})
    inst = SimInstance(config, PROFILE, loop, lambda i, o: None, lambda e: None)
    assert inst.memory.stager is None
    inst.add(call_of("n"))
    plan = inst.scheduler.plan()
    assert plan.gather.path is SwitchPath.H2D_ONLY
    assert inst._switch_record(plan)[1] == pytest.approx(SWITCHES[SwitchPath.H2D_ONLY].total_s, rel=1e-12)


def call_of(model: str):
    from talaria.contracts.call import InstanceCall, SamplingParams

    return InstanceCall(f"{model}-1", model, tuple(range(40)), SamplingParams(max_tokens=4, temperature=0.0))


def test_a_stateful_models_state_region_is_laid_out_and_counted_in_hbm():
    """A model whose profile gives a state slot gets `max_running` live states and as many snapshots
    above its weights (the cache layout rebuilt from the profile), and they count in the HBM peak."""
    state = 64 * KV_PER_TOKEN
    profile = PROFILE.with_model(dataclasses.replace(PROFILE.model("m"), state_bytes=state))
    loop = EventLoop(VirtualClock())
    inst = SimInstance(INSTANCE, profile, loop, lambda i, o: None, lambda e: None)
    plan, slots = inst.layout.plan("m"), 2 * INSTANCE.max_running
    assert (plan.num_state_slots, plan.state_bytes, plan.page_bytes) == (slots, state, 16 * KV_PER_TOKEN)
    assert plan.states.size == -(-slots * state // ALIGN) * ALIGN and plan.kv.start == plan.states.end
    assert inst.layout.plan("n").states.size == 0  # n keeps no state
    inst.add(call_of("m"))  # 40 prompt tokens and 4 out: 3 pages of 16 at most
    loop.run()
    held = plan.weights.size + plan.states.size + inst.runtime_bytes + 3 * plan.page_bytes
    # n's chunks staged in m's KV tail hold HBM too (paper §4.4, Fig. 15): what was staged by the peak
    staged = inst.memory.stager.held_bytes()
    assert staged > 0 and held < inst.hbm_peak_bytes <= held + staged


def test_without_staging_the_hbm_peak_is_weights_states_runtime_and_kv_pages():
    no_staging = dataclasses.replace(INSTANCE, ablations=(Ablation.STAGING,))
    loop = EventLoop(VirtualClock())
    inst = SimInstance(no_staging, PROFILE, loop, lambda i, o: None, lambda e: None)
    plan = inst.layout.plan("m")
    inst.add(call_of("m"))
    loop.run()
    assert inst.memory.stager is None
    assert inst.hbm_peak_bytes == plan.weights.size + plan.states.size + inst.runtime_bytes + 3 * plan.page_bytes


def test_a_stateful_models_steps_are_charged_as_predicted_and_resume_through_snapshots():
    """The agent trace with model m given a per-sequence state: prompt chunks end on page boundaries
    (the scheduler's fit and the batcher's chunk agree), snapshots are taken, saved with the pages
    and restored from host, and every step is charged exactly what the scheduler predicted."""
    profile = PROFILE.with_model(dataclasses.replace(PROFILE.model("m"), state_bytes=64 * KV_PER_TOKEN))
    Recording.seen = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(simulation, "SimInstance", Recording)
        result = Simulation(CONFIG, profile, agent_trace()).run()
    assert all(c.done is not None and c.error is None for c in result.calls)
    steps = [(p, predicted, charged) for p, predicted, charged in Recording.seen if isinstance(p, StepPlan)]
    for plan, predicted, charged in steps:
        assert charged == pytest.approx(predicted, rel=1e-9), plan
    ops = [p.ops for p, _, _ in steps if p.model == "m" and p.ops is not None]
    assert sum(len(o.state_copies) for o in ops) and sum(len(o.state_zero) for o in ops)
    assert sum(len(s.states) for o in ops for s in o.saves) and sum(len(o.state_restores) for o in ops)
    # every resume is where a snapshot was published earlier: a page boundary some step of m reached
    reached = set()
    for p, _, _ in steps:
        if p.model != "m":
            continue
        for c in p.chunks:
            if c.prefix:
                assert c.start_pos in reached or c.start_pos == 0, c
        reached |= {c.context_len for c in p.chunks if c.context_len % 16 == 0}
    assert any(c.prefix and c.start_pos > 0 for p, _, _ in steps if p.model == "m" for c in p.chunks)
