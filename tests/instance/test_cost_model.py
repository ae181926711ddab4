"""`talaria.instance.cost_model`: every instance, hot or cold, corrects its profile from measured steps.

The harness's toy profile prices a prefill at 1/64 s per token and a decode step at 1/16 s; its
steps here are run in twice the time the profile prices them, as on a machine slower than the one
profiled, and the correction must follow and show in telemetry.
"""

from __future__ import annotations

import dataclasses

import pytest

from talaria.contracts.step_plan import StepPlan
from talaria.instance.cost_model import CostModel
from tests.instance.scheduler_harness import PS, RESTORE_S, call, instance, toy_profile


def test_a_hot_instance_learns_that_its_steps_run_slower_than_its_profile():
    inst = instance("a", hot=True)
    assert inst.scheduler.rounds is None
    assert inst.scheduler.stats().cost_scale == {}  # nothing measured yet: the profile as it is
    inst.scheduler.add(call("r1", max_tokens=12))
    kinds = []
    while inst.scheduler.has_work:
        plan = inst.scheduler.plan()
        priced = toy_profile(["a"]).step_s(plan, PS)
        kinds.append("decode" if all(c.decode for c in plan.chunks) else "prefill")
        inst.run(plan, step_s=2 * priced)
    scale = inst.scheduler.stats().cost_scale
    assert kinds[0] == "prefill" and kinds.count("decode") >= 10
    assert scale == {"a/decode": pytest.approx(2.0), "a/prefill": pytest.approx(2.0)}
    # and it follows the machine back: steps at the profile's speed pull the correction towards 1
    inst.scheduler.add(call("r2", max_tokens=6))
    while inst.scheduler.has_work:
        plan = inst.scheduler.plan()
        inst.run(plan, step_s=toy_profile(["a"]).step_s(plan, PS))
    back = inst.scheduler.stats().cost_scale
    assert 1.0 < back["a/decode"] < 1.5 and 1.0 < back["a/prefill"] < 2.0


def test_a_cold_instance_publishes_its_corrections_in_the_same_place():
    inst = instance("a", "b")
    inst.scheduler.add(call("r1", max_tokens=6))
    inst.until_idle(slowdown=3.0)
    scale = inst.scheduler.stats().cost_scale
    assert scale["a/decode"] > 2.0 and scale["a/prefill"] > 2.0
    assert inst.scheduler.stats().rounds is not None


def test_without_learning_the_scales_stay_one():
    inst = instance("a", hot=True, learn=False)
    inst.scheduler.add(call("r1", max_tokens=4))
    while inst.scheduler.has_work:
        plan = inst.scheduler.plan()
        inst.run(plan, step_s=5.0)
    assert inst.scheduler.stats().cost_scale == {}


def test_a_step_is_predicted_as_the_profile_prices_it_times_each_parts_correction():
    profile = toy_profile(["a"])
    costs = CostModel(profile, PS)
    costs.observe("a", "prefill", 1.0, 3.0)
    costs.observe("a", "decode", 1.0, 0.5)
    inst = instance("a", hot=True)
    inst.scheduler.add(call("r1", max_tokens=3))
    plan = inst.scheduler.plan()
    prefill, restore, decode = profile.step_parts(plan, PS)
    assert costs.step_s(plan) == pytest.approx(3.0 * (prefill + restore) + 0.5 * decode)
    assert costs.step_s(StepPlan("a", ())) == 0.0


def test_a_state_restore_is_priced_beside_its_pages_and_corrected_with_prefill():
    base = toy_profile(["a"])
    profile = base.with_model(dataclasses.replace(base.model("a"), state_bytes=3 * base.model("a").token_bytes))
    costs = CostModel(profile, PS)
    costs.observe("a", "prefill", 1.0, 2.0)
    assert costs.restore_s("a", 5, states=1) == pytest.approx(2.0 * 8 * RESTORE_S)  # 5 tokens + 3 tokens' bytes
    assert costs.restore_s("a", 5) == pytest.approx(2.0 * 5 * RESTORE_S)
