"""The dashboard's feeds: an events file replayed on a virtual clock, and a live node (served here by
httpx's MockTransport) followed through dropped streams and restarts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from talaria.tui.clock import NodeClock
from talaria.tui.feed import LiveFeed, ReplayError, ReplayFeed, read_events
from talaria.tui.memory import DeviceMemory
from talaria.tui.state import Connection, DashboardState
from tests.tui.events import event, lease

pytestmark = pytest.mark.anyio


async def until(probe: Callable[[], object], timeout: float = 5.0) -> None:
    """Let the loop run until `probe()` is truthy; fail after `timeout` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not probe():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"still not true after {timeout}s")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(feed, state: DashboardState):
    task = asyncio.create_task(feed.run(state))
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# ---- the events file -----------------------------------------------------------------------------

def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "events.jsonl"
    path.write_text(text)
    return path


def test_read_events_skips_blank_lines(tmp_path):
    path = write(tmp_path, json.dumps(event("round", 1, 1.0)) + "\n\n" + json.dumps(event("round", 2, 2.0)) + "\n")
    assert [e["seq"] for e in read_events(path)] == [1, 2]


@pytest.mark.parametrize(("text", "message"), [
    ('{"seq": 1, "t": 1.0, "instance": "a", "kind": "round"}\n{"seq": 2,\n', r"events\.jsonl:2: not JSON"),
    ('{"t": 1.0, "instance": "a", "kind": "round"}\n', r"events\.jsonl:1: no valid 'seq'"),
    ('{"seq": 1, "t": "soon", "instance": "a", "kind": "round"}\n', r"events\.jsonl:1: no valid 't'"),
    ('[1, 2]\n', r"events\.jsonl:1: not a JSON object"),
    ("\n", r"events\.jsonl: no events in it"),
])
def test_read_events_names_the_file_and_line_of_a_bad_record(tmp_path, text, message):
    with pytest.raises(ReplayError, match=message):
        read_events(write(tmp_path, text))


def test_read_events_of_a_missing_or_binary_file(tmp_path):
    with pytest.raises(ReplayError, match="cannot read it"):
        read_events(tmp_path / "nope.jsonl")
    (tmp_path / "blob.jsonl").write_bytes(b"\xff\xfe\x00 not text")
    with pytest.raises(ReplayError, match="not UTF-8 text"):
        read_events(tmp_path / "blob.jsonl")


class FakeTime:
    """A local clock that only moves when the replay sleeps."""

    def __init__(self, on_sleep: Callable[[], None] | None = None) -> None:
        self.now, self.slept, self._on_sleep = 0.0, [], on_sleep

    def local(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        if self._on_sleep is not None and not self.slept:
            self._on_sleep()
        self.slept.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


async def test_a_replay_keeps_the_recorded_pace_times_the_speed():
    fake = FakeTime()
    events = [lease(1, 10.0, "install", "s", t_exp=11.0), event("round", 2, 10.5), event("round", 3, 12.0)]
    feed = ReplayFeed(events, "events.jsonl", 2.0, clock=NodeClock(fake.local, rate=2.0), sleep=fake.sleep)
    state = DashboardState()
    await feed.run(state)
    assert sum(fake.slept) == pytest.approx(1.0)  # 2 s recorded at 2x
    assert max(fake.slept) <= 0.1  # small steps, so a pause takes effect at once
    assert feed.clock.now() == pytest.approx(12.0)
    assert (state.events, state.status.connection, state.status.detail) == (3, Connection.FINISHED, "3 events")


async def test_a_replay_at_infinite_speed_never_sleeps_and_its_clock_reads_the_last_event():
    fake = FakeTime()
    events = [event("round", 1, 10.0), event("round", 2, 500.0)]
    feed = ReplayFeed(events, "e", math.inf, clock=NodeClock(fake.local), sleep=fake.sleep)
    await feed.run(DashboardState())
    assert fake.slept == [] and feed.clock.now() == 500.0


async def test_pause_stops_the_replay_and_its_clock_and_resume_goes_on_where_it_stopped():
    state = DashboardState()
    fake = FakeTime(on_sleep=lambda: feed.toggle_pause(state))
    feed = ReplayFeed([event("round", 1, 0.0), event("round", 2, 1.0)], "e", 1.0, clock=NodeClock(fake.local),
                      sleep=fake.sleep)
    async with running(feed, state) as task:
        await until(lambda: feed.paused)
        for _ in range(5):
            await asyncio.sleep(0)
        fake.now += 100.0  # a long pause on the local clock
        assert state.events == 1 and state.status.connection is Connection.PAUSED and feed.clock.now() == 0.0
        feed.toggle_pause(state)
        await asyncio.wait_for(task, 5)
    assert state.events == 2 and feed.clock.now() == pytest.approx(1.0)
    assert sum(fake.slept[1:]) == pytest.approx(1.0)  # the paused time was not skipped over


async def test_a_file_with_a_second_run_resets_the_events_state():
    events = [lease(1, 1.0, "install", "s", t_exp=2.0), event("round", 2, 1.5), lease(1, 9.0, "install", "t", t_exp=10.0)]
    state = DashboardState()
    await ReplayFeed(events, "e", math.inf, clock=NodeClock(lambda: 0.0)).run(state)
    assert [x.session for x in state.leases.live()] == ["t"] and state.events == 1


# ---- a live node ---------------------------------------------------------------------------------

class FakeNode:
    """Serves /talaria/telemetry and /talaria/events; each events stream sends what the log holds
    after `since` and ends, as a dropped connection would."""

    def __init__(self, log: list[dict], api_key: str | None = None) -> None:
        self.log, self.api_key = log, api_key
        self.up = True
        self.time = 50.0
        self.sinces: list[int] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if not self.up:
            raise httpx.ConnectError("connection refused", request=request)
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return httpx.Response(401, json={"error": {"message": "bad key"}})
        if request.url.path == "/talaria/telemetry":
            return httpx.Response(200, json={"time": self.time, "instances": {}, "router": {"leases": []}})
        since = int(request.url.params["since"])
        self.sinces.append(since)
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in self.log if e["seq"] > since)
        return httpx.Response(200, content=(": comment\n\n" + body).encode(),
                              headers={"content-type": "text/event-stream"})

    def feed(self, url: str = "http://127.0.0.1:8000", **kwargs) -> LiveFeed:
        return LiveFeed(url, transport=httpx.MockTransport(self.handle), poll_s=0.01, retry_s=0.01,
                        probe=lambda: FakeProbe(), **kwargs)


class FakeProbe:
    def read(self) -> tuple[DeviceMemory, ...]:
        return (DeviceMemory("RAM", 1, 2),)


def run_of(n: int, t0: float, tag: str = "a") -> list[dict]:
    """One run of a node: `n` lease installs, of sessions tag1, tag2, ..."""
    return [lease(i, t0 + i, "install", f"{tag}{i}", t_exp=t0 + i + 1.0) for i in range(1, n + 1)]


async def test_a_dropped_stream_resumes_after_the_last_event_without_folding_it_twice():
    node = FakeNode(run_of(3, 100.0))
    state = DashboardState()
    async with running(node.feed(), state):
        await until(lambda: state.last_seq == 3)
        node.log += run_of(5, 100.0)[3:]
        await until(lambda: state.last_seq == 5)
        await until(lambda: len(node.sinces) > 4)
    assert state.events == 5
    assert node.sinces[0] == 0 and set(node.sinces[1:]) <= {2, 4}  # each resume asks for the last event again


@pytest.mark.parametrize("new_run", [run_of(2, 500.0, "b"), run_of(5, 500.0, "b")], ids=["shorter", "longer"])
async def test_a_restarted_node_is_read_again_from_its_first_event(new_run):
    node = FakeNode(run_of(3, 100.0))
    state = DashboardState()
    async with running(node.feed(), state):
        await until(lambda: state.last_seq == 3)
        node.log = new_run
        await until(lambda: state.events == len(new_run) and state.last_seq == len(new_run)
                    and 0 in node.sinces[1:])
    assert [x.session for x in state.leases.live()] == [e["session"] for e in new_run]


async def test_the_status_says_disconnected_while_the_node_is_away_and_recovers_by_itself():
    node = FakeNode(run_of(1, 1.0))
    state = DashboardState()
    feed = node.feed()
    async with running(feed, state):
        await until(lambda: state.status.connection is Connection.CONNECTED)
        assert feed.clock.now() >= 50.0 and state.devices == (DeviceMemory("RAM", 1, 2),)
        node.up = False
        await until(lambda: state.status.connection is Connection.DISCONNECTED)
        assert "cannot connect" in state.status.detail
        node.up, node.time = True, 60.0
        await until(lambda: state.status.connection is Connection.CONNECTED)
        assert feed.clock.now() >= 60.0


async def test_a_wrong_key_is_reported_and_the_right_one_is_sent():
    node = FakeNode(run_of(1, 1.0), api_key="sesame")
    state = DashboardState()
    async with running(node.feed(), state):
        await until(lambda: state.status.connection is Connection.DISCONNECTED)
        assert "--api-key" in state.status.detail
    async with running(node.feed(api_key="sesame"), state):
        await until(lambda: state.status.connection is Connection.CONNECTED and state.last_seq == 1)


async def test_device_memory_is_read_only_for_a_node_on_this_machine():
    node = FakeNode(run_of(1, 1.0))
    state = DashboardState()
    remote = LiveFeed("http://10.0.0.5:8000", transport=httpx.MockTransport(node.handle), poll_s=0.01)
    async with running(remote, state):
        await until(lambda: state.status.connection is Connection.CONNECTED)
    assert state.devices == ()
    local = LiveFeed("http://localhost:8000", transport=httpx.MockTransport(node.handle), poll_s=0.01)
    async with running(local, state):
        await until(lambda: state.devices)
    assert state.devices[-1].total > 0


@pytest.mark.parametrize("answer", [httpx.Response(200, json=[1, 2]), httpx.Response(200, text="<html>hi</html>")],
                         ids=["a list", "html"])
async def test_a_server_that_is_not_talaria_is_said_to_be_so(answer):
    state = DashboardState()
    feed = LiveFeed("http://127.0.0.1:8000", transport=httpx.MockTransport(lambda request: answer), retry_s=0.01)
    async with running(feed, state):
        await until(lambda: state.status.connection is Connection.DISCONNECTED)
    assert "not Talaria's JSON" in state.status.detail
