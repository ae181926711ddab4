"""bench/chaos.py's verdicts, each shown to fail the run on the defect it guards against: a restart of
an instance the kill does not explain, a failure code a killed instance's calls may not end with, a
mechanism the run did not exercise. The error bodies are the gateway's own (its instance_error), as a
real kill produces them."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest

from talaria.gateway.errors import UNAVAILABLE, APIError
from talaria.gateway.http import instance_error
from talaria.node.errors import CallFailed, InstanceFailed, InstanceUnavailable
from tests.bench.scripts import load_bench


@pytest.fixture(scope="module")
def chaos():
    return load_bench("chaos")


def reply_of(chaos, error: APIError, in_band: bool = False):
    """What bench/chaos.py's client makes of the gateway's error: a status and body, or an in-band event."""
    return chaos.error_reply(200 if in_band else error.status, json.dumps(error.body()))


def test_the_killed_instance_restarting_once_is_the_only_restart_explained(chaos) -> None:
    before = {"hot-0": 2, "cold-0": 0}
    assert chaos.restart_problem("cold-0", before, {"hot-0": 2, "cold-0": 1}) is None
    wrong = {"the other instance instead": {"hot-0": 3, "cold-0": 0}, "both": {"hot-0": 3, "cold-0": 1},
             "the killed one twice": {"hot-0": 2, "cold-0": 2}, "none": {"hot-0": 2, "cold-0": 0}}
    for case, after in wrong.items():
        assert chaos.restart_problem("cold-0", before, after) is not None, case
    assert "hot-0 +1" in chaos.restart_problem("cold-0", before, wrong["the other instance instead"])


def test_a_wrong_restart_fails_the_run(chaos) -> None:
    tally = chaos.Tally(0)
    assert tally.bad == 0
    tally.wrong_restart("kill", 3, chaos.restart_problem("cold-0", {"hot-0": 0, "cold-0": 0}, {"hot-0": 1, "cold-0": 0}))
    assert tally.bad == 1 and tally.counts["kill"]["wrong_restarts"] == 1
    assert tally.incidents[0]["what"] == "wrong restart" and "--only kill --first 3" in tally.incidents[0]["repro"]


def test_a_killed_instances_calls_may_fail_only_with_the_documented_codes(chaos) -> None:
    completion, switch = {"model": "tiny-llama", "prompt": [1, 2]}, {"instance": "cold-0", "model": "tiny-llama"}
    died = instance_error(InstanceFailed("instance cold-0 exited"), "r1")
    restarting = instance_error(InstanceUnavailable("instance cold-0 is not ready"), "r2")
    switch_failed = APIError(503, "instance cold-0 is not ready", UNAVAILABLE, None, "switch_failed")  # admin.py's
    call_failed = instance_error(CallFailed("a grammar the vocabulary cannot follow"), "r3")
    rate_limited = APIError(429, "overloaded", "rate_limit_error", None, "rate_limit_exceeded")
    cases = [  # (body, on the killed instance, reply, the kill explains it)
        (completion, True, reply_of(chaos, died), True),
        (completion, True, reply_of(chaos, died, in_band=True), True),
        (completion, True, reply_of(chaos, restarting), True),
        (switch, True, reply_of(chaos, switch_failed), True),
        (completion, True, reply_of(chaos, call_failed), False),  # one call failed alone: not the kill
        (completion, True, reply_of(chaos, rate_limited), False),
        (completion, True, reply_of(chaos, switch_failed), False),  # a switch's code on a completion
        (switch, True, reply_of(chaos, died), False),
        (completion, False, reply_of(chaos, died), False),  # the other instance, or a call after the restart
    ]
    for body, on_victim, reply, explained in cases:
        assert reply.problem is None, reply.problem  # clean: the API's JSON error
        tally = chaos.Tally(0)
        chaos.judge_failure(tally, 0, "call", reply, chaos.allowed_codes(body, on_victim))
        assert tally.counts["kill"]["clean_failures"] == 1
        assert (tally.bad == 0) is explained, (body, on_victim, reply.status, reply.code)
        if not explained:
            assert tally.incidents[0]["what"] == "unexpected failure"


def test_a_500_without_a_code_is_unclean_whatever_the_instance(chaos) -> None:
    reply = chaos.error_reply(500, json.dumps(APIError(500, "internal server error", "server_error").body()))
    tally = chaos.Tally(0)
    chaos.judge_failure(tally, 0, "call", reply, chaos.KILLED_CALL_CODES)
    assert tally.counts["kill"]["unclean_failures"] == 1 and tally.bad == 1


def quick_plan(chaos) -> dict[str, int]:
    return chaos.plan(chaos.QUICK_TRIALS, None)


def test_every_required_mechanism_at_its_minimum_passes(chaos) -> None:
    planned = quick_plan(chaos)
    seen = {kind: Counter(chaos.COVERAGE[kind]) for kind in chaos.KINDS}
    assert chaos.shortfalls(seen, planned) == []


@pytest.mark.parametrize("kind", ["tp1", "tp2", "kill"])
def test_a_mechanism_exercised_once_too_few_fails_as_not_exercised(chaos, kind: str) -> None:
    planned = quick_plan(chaos)
    assert chaos.COVERAGE[kind]  # every kind requires something: this loop is not empty
    for mechanism, least in chaos.COVERAGE[kind].items():
        seen = {k: Counter(chaos.COVERAGE[k]) for k in chaos.KINDS}
        seen[kind][mechanism] = least - 1  # e.g. preemption disabled: it happens in fewer trials
        assert chaos.shortfalls(seen, planned) == [
            f"did not exercise {mechanism} in {kind} trials: in {least - 1} of {planned[kind]}, at least {least} required"]


def test_a_run_with_preemption_disabled_fails_as_not_exercised(chaos) -> None:
    planned = quick_plan(chaos)
    tally = chaos.Tally(0)
    for kind in chaos.KINDS:
        tally.counts[kind]["trials"] = planned[kind]
        tally.mechanisms[kind].update(chaos.COVERAGE[kind])
    args = SimpleNamespace(seed=0, first=0, deadline_s=60.0)
    out = chaos.result(tally, planned, args, chaos.ProgressLog(), 0.0)
    assert out["passed"] and out["not_exercised"] == []
    for kind in chaos.KINDS:  # a defect that stops preemption: no trial preempts, hybrid or MLA either
        for mechanism in [m for m in tally.mechanisms[kind] if m.endswith("preemption")]:
            tally.mechanisms[kind][mechanism] = 0
    out = chaos.result(tally, planned, args, chaos.ProgressLog(), 0.0)
    assert not out["passed"] and tally.bad == 0  # no incident: the shortfall alone fails it
    assert out["not_exercised"] == [
        f"did not exercise {m} in {kind} trials: in 0 of {planned[kind]}, at least {chaos.COVERAGE[kind][m]} required"
        for kind, m in [("tp1", "preemption"), ("tp1", "hybrid_preemption"), ("tp1", "mla_preemption"),
                        ("tp2", "preemption")]]


def test_the_minimums_cover_what_the_table_names(chaos) -> None:
    # the coverage table's core mechanisms (the issue names preemption, host KV restore and dirty staged
    # chunks), each required in in-process trials: --quick's runs of seeds 0-3 exercised every one
    for mechanism in ("preemption", "host_kv_restore", "dirty_staged_chunks", "switch", "switch_from_staged_chunks",
                      "device_prefix_hit", "host_kv_eviction", "cancel"):
        assert chaos.COVERAGE["tp1"].get(mechanism, 0) >= 1, mechanism


def test_minimums_scale_with_the_trials_and_vanish_for_a_repro(chaos) -> None:
    full = chaos.coverage_minimums(chaos.plan(1200, None))
    quick = chaos.coverage_minimums(quick_plan(chaos))
    assert quick == chaos.COVERAGE
    for kind in chaos.KINDS:
        for mechanism, least in quick[kind].items():
            assert full[kind][mechanism] >= least * (chaos.plan(1200, None)[kind] // quick_plan(chaos)[kind])
    repro = chaos.coverage_minimums(chaos.plan(1, "kill"))
    assert all(n == 0 for minimums in repro.values() for n in minimums.values())
    nothing = {kind: Counter() for kind in chaos.KINDS}
    assert chaos.shortfalls(nothing, chaos.plan(1, "tp1")) == []
