"""Closed-loop replay against the real gateway over loopback HTTP, with FakeEchoSupervisor behind it.

The gateway runs under uvicorn in a thread on a socket bound before the thread starts, so a client
can connect at once: the kernel queues the connection until uvicorn accepts it (no start-up wait).
Exact timing checks use `VirtualTime`, a clock that moves only when the replay sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise

import pytest

from talaria.replay import (
    ReplayCall,
    ReplaySession,
    agent_sessions,
    percentile,
    replay_sync,
)
from tests.conftest import free_port
from tests.gateway.fakes import MODEL, FakeEchoGroup, serve_over_loopback


@dataclass
class RecordingGroup(FakeEchoGroup):
    """A FakeEchoGroup that also notes, per call, how many calls had completed when it arrived."""

    completed_at_arrival: list[int] = field(default_factory=list)

    async def generate(self, call):
        self.completed_at_arrival.append(len(self.completed))
        async for out in super().generate(call):
            yield out


@dataclass
class EchoServer:
    base_url: str
    group: RecordingGroup


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    group = RecordingGroup("hot0")
    with serve_over_loopback(group) as url:
        yield EchoServer(url, group)


class VirtualTime:
    """A clock that moves only when the replay sleeps, so every intended time is exact."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


def body(prompt: str, max_tokens: int, model: str = MODEL, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def session(sid: str, *calls: tuple[dict, float]) -> ReplaySession:
    return ReplaySession(sid, tuple(ReplayCall(b, gap) for b, gap in calls))


def test_calls_run_in_order_each_released_after_the_previous_done_plus_gap(echo):
    s = session("a", (body("abc", 5), 0.0), (body("xy", 3), 0.05), (body("q", 2), 0.05))
    seen = []
    result = replay_sync(echo.base_url, [s], on_call=seen.append)
    calls = result.sessions[0].calls
    assert [c.text for c in calls] == ["abcab", "xyx", "qq"]
    assert [c.status for c in calls] == [200, 200, 200] and all(c.ok for c in calls)
    assert echo.group.completed_at_arrival == [0, 1, 2]  # the server saw each call only after the last ended
    assert seen == list(calls)
    for prev, c in pairwise(calls):
        assert c.intended_s == prev.done_s + 0.05
        assert c.sent_s >= c.intended_s
    assert all(c.first_token_s is not None and c.sent_s <= c.first_token_s <= c.done_s for c in calls)
    assert calls[0].usage["completion_tokens"] == 5 and calls[0].usage["prompt_tokens"] == 3
    assert 0 <= calls[1].request_ttft_s <= calls[1].ttft_s
    assert result.sessions[0].sct_s == calls[-1].done_s - calls[0].intended_s


def test_gaps_are_capped_and_sct_is_exact_in_virtual_time(echo):
    vt = VirtualTime()
    s = session("a", (body("a", 1), 1.0), (body("b", 1), 2.0), (body("c", 1), 30.0))
    result = replay_sync(echo.base_url, [s], gap_cap_s=10.0, clock=vt, sleep=vt.sleep)
    calls = result.sessions[0].calls
    assert vt.sleeps == [1.0, 2.0, 10.0]  # the 30 s gap is capped at 10 s
    assert [c.intended_s for c in calls] == [101.0, 103.0, 113.0]
    assert [c.ttft_s for c in calls] == [0.0, 0.0, 0.0]
    assert result.sessions[0].sct_s == 12.0  # first intended enqueue (101) -> last response (113)
    assert result.wall_s == 13.0
    summary = result.to_dict()["summary"]
    assert summary["sct_sum_s"] == 12.0 and summary["errors"] == 0 and summary["calls"] == 3


def test_sessions_start_together(echo):
    vt = VirtualTime()
    sessions = [session(f"s{i}", (body("ab", 2), 0.0), (body("cd", 2), 0.0)) for i in range(4)]
    result = replay_sync(echo.base_url, sessions, clock=vt, sleep=vt.sleep)
    assert [s.session_id for s in result.sessions] == ["s0", "s1", "s2", "s3"]
    assert {s.calls[0].intended_s for s in result.sessions} == {100.0}
    assert vt.sleeps == []
    assert [c.text for c in result.calls] == ["ab", "cd"] * 4


def test_chat_endpoint_times_the_first_content_chunk(echo):
    chat = ReplayCall({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                      0.0, endpoint="/v1/chat/completions")
    call = replay_sync(echo.base_url, [ReplaySession("c", (chat,))]).calls[0]
    assert call.ok and call.text == "<|i"  # the echo of the templated prompt
    assert call.usage["completion_tokens"] == 3


def test_errors_are_recorded_not_raised_and_the_session_goes_on(echo):
    s = session("a", (body("abc", 2, model="nope"), 0.0), (body("abc", 4), 0.0))
    missing, fine = replay_sync(echo.base_url, [s]).calls
    assert missing.status == 404 and "'nope' does not exist" in missing.error
    assert missing.text == "" and missing.first_token_s is None and missing.ttft_s is None and not missing.ok
    assert fine.ok and fine.text == "abca"

    echo.group.fail_after = 2  # dies mid-stream: HTTP 200, then an error event and no [DONE]
    broken = replay_sync(echo.base_url, [session("b", (body("abc", 5), 0.0))]).calls[0]
    assert broken.status == 200 and "hot0 died" in broken.error and not broken.ok
    assert broken.text == "ab" and broken.first_token_s is not None


def test_transport_errors_are_recorded(echo):
    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused
    s = session("a", (body("a", 1), 0.0), (body("b", 1), 0.0))
    result = replay_sync(nobody, [s])
    assert [c.status for c in result.calls] == [0, 0]
    assert all(c.error.startswith("ConnectError") for c in result.calls)
    assert result.summary()["errors"] == 2


def test_invalid_arguments_are_rejected():
    with pytest.raises(ValueError, match="gap_before_s"):
        ReplayCall(body("a", 1), -1.0)
    with pytest.raises(ValueError, match="endpoint"):
        ReplayCall(body("a", 1), 0.0, endpoint="v1/completions")
    twice = [session("a", (body("a", 1), 0.0))] * 2
    with pytest.raises(ValueError, match="unique"):
        replay_sync("http://127.0.0.1:9", twice)
    with pytest.raises(ValueError, match="gap_cap_s"):
        replay_sync("http://127.0.0.1:9", [], gap_cap_s=-1)


def test_nearest_rank_percentiles():
    assert percentile([15, 20, 35, 40, 50], 30) == 20  # rank ceil(1.5) = 2
    assert percentile([15, 20, 35, 40, 50], 40) == 20  # rank 2 exactly
    assert percentile([50, 15, 40, 20, 35], 50) == 35  # unsorted input
    assert percentile([15, 20, 35, 40, 50], 100) == 50
    assert percentile([15, 20, 35, 40, 50], 0) == 15
    assert percentile(range(1, 21), 95) == 19  # p95 of 20 values is the 19th
    assert percentile(range(1, 11), 70) == 7  # 0.7 * 10 is not 7 in floats; the rank still is
    assert percentile([3.5], 95) == 3.5
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 101)


AGENT = {"seed": 7, "system_chars": 200, "tool_chars": 50, "max_tokens": 4, "gap_s": (0.1, 0.3)}


def test_agent_sessions_are_deterministic_for_a_seed():
    a = agent_sessions(["m1", "m2"], 2, 3, **AGENT)
    assert a == agent_sessions(["m1", "m2"], 2, 3, **AGENT)
    assert a != agent_sessions(["m1", "m2"], 2, 3, **{**AGENT, "seed": 8})


def test_agent_sessions_prompts_extend_the_previous_ones():
    sessions = agent_sessions(["m1", "m2"], 2, 4, **AGENT)
    assert [s.session_id for s in sessions] == ["m1-s0", "m2-s0", "m1-s1", "m2-s1"]
    for s in sessions:
        model = s.session_id.split("-")[0]
        prompts = [c.body["prompt"] for c in s.calls]
        assert len(prompts) == 4
        assert prompts[0].startswith(f"You are a coding agent running on {model}")
        for prev, nxt in pairwise(prompts):
            assert nxt.startswith(prev) and len(nxt) >= len(prev) + 50
        for c in s.calls:
            assert c.body == {"model": model, "prompt": c.body["prompt"], "max_tokens": 4, "ignore_eos": True,
                              "temperature": 0, "session_id": s.session_id}
            assert c.endpoint == "/v1/completions"
        assert 0.0 <= s.calls[0].gap_before_s <= 0.3
        assert all(0.1 <= c.gap_before_s <= 0.3 for c in s.calls[1:])
    system = {s.session_id: s.calls[0].body["prompt"][:200] for s in sessions}
    assert system["m1-s0"] == system["m1-s1"] != system["m2-s0"]  # one system prompt per model
    assert sessions[0].calls[0].body["prompt"] != sessions[2].calls[0].body["prompt"]  # own task line


def test_agent_sessions_reject_bad_shapes():
    with pytest.raises(ValueError, match="gap_s"):
        agent_sessions(["m"], 1, 1, **{**AGENT, "gap_s": (0.5, 0.1)})
    with pytest.raises(ValueError, match="distinct"):
        agent_sessions(["m", "m"], 1, 1, **AGENT)
    with pytest.raises(ValueError, match="at least 1"):
        agent_sessions(["m"], 1, 0, **AGENT)
    for bad in (0, (5, 2), (0, 3)):
        with pytest.raises(ValueError, match="max_tokens"):
            agent_sessions(["m"], 1, 1, **{**AGENT, "max_tokens": bad})


def test_agent_sessions_draw_max_tokens_from_a_range():
    ranged = {**AGENT, "max_tokens": (2, 9)}
    sessions = agent_sessions(["m1", "m2"], 3, 5, **ranged)
    counts = [c.body["max_tokens"] for s in sessions for c in s.calls]
    assert all(2 <= n <= 9 for n in counts) and len(set(counts)) > 3
    assert sessions == agent_sessions(["m1", "m2"], 3, 5, **ranged)


def test_agent_sessions_replay_verbatim(echo):
    sessions = agent_sessions([MODEL], 2, 3, **{**AGENT, "gap_s": (0.0, 0.02)})
    result = replay_sync(echo.base_url, sessions)
    assert result.summary()["errors"] == 0
    for s, r in zip(sessions, result.sessions):
        assert [c.text for c in r.calls] == [c.body["prompt"][:4] for c in s.calls]  # echo of what was sent
        assert r.sct_s > 0
    assert [c.session_id for c in echo.group.calls] != []
    assert sorted(c.session_id for c in echo.group.calls) == sorted([s.session_id for s in sessions] * 3)
