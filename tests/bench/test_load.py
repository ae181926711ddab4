"""bench/load.py's verdicts, each shown to fail on the defect it guards against: a node that admits 32
of 200 sessions and sheds the rest, a failed call of an admitted session (failing even with
--no-gate); and its client's reading of refusals (a 503 over capacity is backed off on and, given up
on, a shed session, not a server error), against a scripted transport."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from talaria.config.loader import load_config
from tests.bench.scripts import load_bench

TURNS = 6
GROWTH = {"supervisor": {"warm_mib": 80.0, "end_mib": 81.0, "growth": 0.0125}}


@pytest.fixture(scope="module")
def load():
    return load_bench("load")


def admitted(load, i: int, fail_call: int | None = None):
    """A session served well (TTFT 0.5 s, a call every 10 s), its call `fail_call` failing if given."""
    rec = load.SessionRecord(f"s{i}", "smollm2", TURNS, start_s=0.0, admitted_s=0.1)
    for j in range(TURNS):
        c = load.CallRecord(rec.id, j, "smollm2", sent_s=10.0 * j, done_s=10.0 * j + 3, attempts=1, status=200,
                            answered_s=10.0 * j + 0.1, ttft_s=0.5, first_token_s=10.0 * j + 0.5)
        rec.calls.append(c)
        if j == fail_call:
            c.status, c.error = 500, "HTTP 500: internal error"
            rec.outcome, rec.end_s = load.Outcome.FAILED, c.done_s
            return rec
    rec.outcome, rec.end_s = load.Outcome.FINISHED, rec.calls[-1].done_s
    return rec


def shed(load, i: int):
    """A session whose first call was refused six times: its client gave up."""
    rec = load.SessionRecord(f"s{i}", "smollm2", TURNS, start_s=0.0, outcome=load.Outcome.SHED)
    rec.calls.append(load.CallRecord(rec.id, 0, "smollm2", sent_s=0.0, done_s=12.0, attempts=6, n429=6, refused=6,
                                     status=429, gave_up=True, error="429 after 5 retries"))
    return rec


def verdict(load, sessions, workload="burst", capacity_per_min=1200.0):
    summary = load.summarize(sessions, wall_s=60.0)
    capacity = {"capacity_sessions": 200, "capacity_calls_per_min": capacity_per_min}
    return load.misses(summary, GROWTH, load.WORKLOADS[workload], 2.0, capacity)


def test_all_admitted_and_served_well_passes(load) -> None:
    missed, wrong = verdict(load, [admitted(load, i) for i in range(200)])
    assert (missed, wrong) == ([], [])


@pytest.mark.parametrize("workload", ["burst", "patient"])
def test_a_node_that_admits_32_of_200_fails(load, workload, capsys) -> None:
    report = load_bench("report")
    missed, wrong = verdict(load, [admitted(load, i) for i in range(32)] + [shed(load, i) for i in range(32, 200)],
                            workload)
    assert wrong == []  # shedding new sessions is allowed; it misses the targets
    assert any(m.startswith("admitted fraction 0.16: 32 of 200 sessions, 168 gave up") for m in missed)
    assert any(m.startswith("goodput 192.0 calls/min") for m in missed)  # 32 x 6 calls in a minute, of 1200
    assert report.gate(missed, wrong, no_gate=False) == 1


def test_many_429s_per_admitted_session_fail_the_patient_workload_only(load) -> None:
    sessions = [admitted(load, i) for i in range(10)]
    for s in sessions:
        s.calls[0].n429 = s.calls[0].refused = 4
    assert any("4.00 429s per admitted session (target <= 3)" in m for m in verdict(load, sessions, "patient",
                                                                                    60.0)[0])
    assert verdict(load, sessions, "burst", 60.0) == ([], [])


def test_a_failed_call_of_an_admitted_session_fails_even_with_no_gate(load) -> None:
    report = load_bench("report")
    missed, wrong = verdict(load, [admitted(load, i) for i in range(199)] + [admitted(load, 199, fail_call=2)],
                            capacity_per_min=1100.0)
    assert wrong[0].startswith("1 failed calls of admitted sessions")
    assert "1 admitted sessions did not finish (target 0)" in missed
    assert report.gate(missed, wrong, no_gate=True) == 1


def run_session(load, workload: str, replies: list[httpx.Response]):
    """One planned session of `workload` through the bench's client, the node's answers scripted."""
    answers = iter(replies)

    async def go():
        transport = httpx.MockTransport(lambda request: next(answers))
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as http:
            client = load.Client(http, "http://node", 0.0, load.WORKLOADS[workload])
            plan = load.plan_sessions(["smollm2"], 0, workload=load.WORKLOADS[workload])[0]
            return await client.session(plan, delay=False)

    return asyncio.run(go())


def refusal(status: int, code: str) -> httpx.Response:
    return httpx.Response(status, headers={"Retry-After": "1", "retry-after-ms": "1"},
                          json={"error": {"message": "busy", "type": "x", "code": code}})


def streamed(text: str) -> httpx.Response:
    chunks = [{"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"content": text}}]},
              {"choices": [{"delta": {}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 9}}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})


def test_a_client_given_up_on_over_capacity_is_shed_not_a_server_error(load) -> None:
    rec = run_session(load, "patient", [refusal(503, "over_capacity")] * 31)  # 30 retries, retry-after-ms 1
    assert rec.outcome is load.Outcome.SHED
    call = rec.calls[0]
    assert (call.attempts, call.refused, call.n429, call.gave_up) == (31, 31, 0, True)
    s = load.summarize([rec], wall_s=1.0)
    assert (s["shed"], s["failed_calls_not_refused"], s["over_capacity_refusals"]) == (1, 0, 31)


def test_refusals_then_answers_admit_the_session_and_count_its_429s(load) -> None:
    rec = run_session(load, "patient", [refusal(429, "rate_limit_exceeded")] * 2 + [streamed("ok")] * TURNS)
    assert rec.outcome is load.Outcome.FINISHED and rec.admitted_s is not None
    first = rec.calls[0]
    assert (first.attempts, first.n429, first.refused, first.text) == (3, 2, 2, "ok")
    assert first.ttft_s is not None and first.first_token_s >= first.sent_s
    assert load.summarize([rec], wall_s=1.0)["mean_429_per_admitted"] == 2.0


def test_a_server_error_on_a_first_call_is_wrong_not_shedding(load) -> None:
    rec = run_session(load, "burst", [httpx.Response(500, json={"error": {"message": "boom"}})])
    assert rec.outcome is load.Outcome.REFUSED
    assert load.misses(load.summarize([rec], wall_s=1.0), GROWTH, load.WORKLOADS["burst"], 2.0, None)[1]


def test_capacity_is_the_largest_concurrency_within_the_target(load) -> None:
    points = [{"sessions": n, "ttft_p95_s": p95, "failed": failed, "calls_per_min": n * 10.0}
              for n, p95, failed in ((2, 0.5, 0), (4, 1.9, 0), (8, 2.1, 0), (12, 1.5, 1), (16, 4.0, 0))]
    cap = load.capacity_of(points, 2.0)
    assert (cap["capacity_sessions"], cap["capacity_calls_per_min"]) == (4, 40.0)
    assert load.capacity_of(points[2:], 2.0)["capacity_sessions"] is None


def test_the_sweep_config_queues_every_call(load, tmp_path: Path) -> None:
    cfg = load_config(load.queue_config(load.DEFAULT_CONFIG, tmp_path / "queue.toml"))
    assert (cfg.router.overload.value, cfg.router.max_queued, cfg.router.queue_timeout_s) == ("queue", 4096, 600.0)


def test_a_run_cut_off_by_max_wall_misses_without_counting_its_calls_in_flight_as_failed(load) -> None:
    rec = admitted(load, 0)
    rec.calls[-1].done_s, rec.calls[-1].ttft_s = 0.0, None  # the call in flight when the run was cut off
    rec.outcome, rec.end_s = load.Outcome.CUT_OFF, None
    s = load.summarize([rec], wall_s=60.0)
    assert (s["cut_off"], s["calls_ok"], s["failed_calls_admitted"], s["admitted_unfinished"]) == (1, 5, 0, 1)
    missed, wrong = load.misses(s, GROWTH, load.WORKLOADS["patient"], 2.0, {"capacity_calls_per_min": 5.0})
    assert wrong == [] and "1 sessions cut off by --max-wall: the run did not finish" in missed
