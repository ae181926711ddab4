"""Where the dashboard's data comes from: a running node, or a recorded event log.

`LiveFeed` polls `GET /talaria/telemetry` and follows `GET /talaria/events` (server-sent events),
and keeps doing so through outages: a lost stream is resumed from the last sequence number seen.
Sequence numbers start again at 1 with every `talaria up`, so a resume first asks for the last
event again and compares it with the one it has; if the node answers with a different event or
none, it restarted, and the dashboard forgets the old run and reads the new one from the start.

`ReplayFeed` plays an events JSONL file (`[telemetry] events_path`, or `talaria sim --events`) at
its recorded pace times a speed factor, on a virtual node clock that stops while paused. A file
can hold several runs; each new run (its `seq` starts again) resets the event-derived state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx

from talaria.tui.clock import NodeClock
from talaria.tui.memory import DeviceProbe
from talaria.tui.state import Connection, DashboardState, FeedStatus

POLL_S = 0.5  # telemetry snapshots come every 0.25-0.5 s; polling faster shows nothing new
RETRY_S = 1.0
RESUME_WAIT_S = 2.0  # a resumed stream replays buffered events at once; silence means a new run
REQUEST_TIMEOUT_S = 5.0
REPLAY_TICK_S = 0.1  # longest sleep while waiting for the next recorded event (keeps pause responsive)
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
ENVELOPE = {"seq": int, "t": (int, float), "instance": str, "kind": str}
NOT_TALARIA = "the telemetry answer is not Talaria's JSON (is this a Talaria node?)"


class Feed(Protocol):
    """A data source; `run` folds everything it reads into the state until cancelled."""

    clock: NodeClock
    source: str

    async def run(self, state: DashboardState) -> None: ...


class LiveFeed:
    """A running node's telemetry and event stream, reconnecting by itself."""

    def __init__(self, url: str, api_key: str | None = None, *, clock: NodeClock | None = None,
                 probe: Callable[[], DeviceProbe] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, poll_s: float = POLL_S,
                 retry_s: float = RETRY_S) -> None:
        self.source = url.rstrip("/")
        self.clock = clock or NodeClock()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._transport = transport
        self._poll_s, self._retry_s = poll_s, retry_s
        # device memory is this machine's: it describes the node only when the node runs here
        self._probe_factory = probe if probe is not None else (DeviceProbe if _is_local(url) else None)
        self._last: tuple[int, float, str] | None = None  # (seq, t, kind) of the last event folded
        self._lost = asyncio.Event()  # set by the poller when the node stops answering

    async def run(self, state: DashboardState) -> None:
        state.status = FeedStatus(Connection.CONNECTING, self.source)
        probe = self._probe_factory() if self._probe_factory is not None else None
        async with httpx.AsyncClient(base_url=self.source, headers=self._headers, transport=self._transport,
                                     timeout=REQUEST_TIMEOUT_S) as client:
            await asyncio.gather(self._poll(client, state, probe), self._follow(client, state))

    async def _poll(self, client: httpx.AsyncClient, state: DashboardState, probe: DeviceProbe | None) -> None:
        while True:
            try:
                r = await client.get("/talaria/telemetry")
                r.raise_for_status()
                body = r.json()
            except (httpx.HTTPError, ValueError) as e:
                body, why = None, _why(e)
            else:
                why = None if isinstance(body, dict) else NOT_TALARIA
            if why is not None:
                state.status = FeedStatus(Connection.DISCONNECTED, self.source, why)
                self._lost.set()
                await asyncio.sleep(self._retry_s)
                continue
            state.apply_telemetry(body)
            if isinstance(body.get("time"), (int, float)):
                self.clock.anchor(body["time"])
            if probe is not None:
                state.devices = probe.read()
            state.status = FeedStatus(Connection.CONNECTED, self.source)
            await asyncio.sleep(self._poll_s)

    async def _follow(self, client: httpx.AsyncClient, state: DashboardState) -> None:
        """Read the stream until it ends or the poller sees the node go away, then read it again."""
        while True:
            self._lost.clear()
            reader = asyncio.create_task(self._read(client, state))
            lost = asyncio.create_task(self._lost.wait())
            try:
                await asyncio.wait({reader, lost}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (reader, lost):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await asyncio.sleep(self._retry_s)

    async def _read(self, client: httpx.AsyncClient, state: DashboardState) -> None:
        resume = self._last
        since = resume[0] - 1 if resume is not None else 0
        try:
            async with client.stream("GET", "/talaria/events", params={"since": since},
                                     timeout=httpx.Timeout(REQUEST_TIMEOUT_S, read=None)) as r:
                r.raise_for_status()
                events = _sse_records(r.aiter_lines())
                if resume is not None and not await self._same_run(events, resume, state):
                    state.reset_events()
                    self._last = None
                    return
                async for e in events:
                    self._fold(state, e)
        except httpx.HTTPError:
            return  # the poller reports the outage; the caller reconnects

    async def _same_run(self, events: AsyncIterator[dict], resume: tuple[int, float, str],
                        state: DashboardState) -> bool:
        """Whether a resumed stream continues the run we were reading (see the module docstring)."""
        try:
            first = await asyncio.wait_for(anext(events), RESUME_WAIT_S)
        except (TimeoutError, StopAsyncIteration):
            return False
        if first["seq"] == resume[0]:
            return (first["seq"], first["t"], first["kind"]) == resume
        self._fold(state, first)  # the buffer no longer holds our last event: a gap, not a restart
        return True

    def _fold(self, state: DashboardState, e: dict[str, Any]) -> None:
        state.apply_event(e)
        self._last = (e["seq"], e["t"], e["kind"])


class ReplayError(ValueError):
    """An events file the replay cannot read; names the file and the line."""


def read_events(path: Path) -> list[dict[str, Any]]:
    """The records of an events JSONL file, each checked for the envelope (seq, t, instance, kind)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ReplayError(f"{path}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ReplayError(f"{path}: not UTF-8 text; an events file is JSON lines (docs/events.md)") from None
    events = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReplayError(f"{path}:{n}: not JSON ({e.msg}); each line must be one event record") from None
        missing = _envelope_error(record)
        if missing:
            raise ReplayError(f"{path}:{n}: {missing}; each line must be one event record (docs/events.md)")
        events.append(record)
    if not events:
        raise ReplayError(f"{path}: no events in it; write one with [telemetry] events_path or "
                          "`talaria sim --events`")
    return events


class ReplayFeed:
    """An event log played back on a virtual node clock; `speed` = inf plays it all at once."""

    def __init__(self, events: list[dict[str, Any]], source: str, speed: float = 1.0, *,
                 clock: NodeClock | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if not speed > 0:
            raise ValueError(f"speed must be > 0, not {speed}")
        self.events, self.source, self.speed = events, source, speed
        self.clock = clock or NodeClock(rate=speed if math.isfinite(speed) else 1.0)
        self._sleep = sleep
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._played = 0  # events folded so far
        self._done = False

    @classmethod
    def from_file(cls, path: Path, speed: float = 1.0, **kwargs: Any) -> ReplayFeed:
        return cls(read_events(path), str(path), speed, **kwargs)

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    def toggle_pause(self, state: DashboardState) -> None:
        if self.paused:
            self.clock.resume()
            self._resumed.set()
        else:
            self.clock.pause()
            self._resumed.clear()
        self._report(state)

    async def run(self, state: DashboardState) -> None:
        previous = 0
        for i, e in enumerate(self.events):
            if e["seq"] <= previous:  # a new run of the node in the same file
                state.reset_events()
            if i == 0 or e["seq"] <= previous or not math.isfinite(self.speed):
                self.clock.anchor(e["t"])
            await self._until(e["t"])
            state.apply_event(e)
            previous, self._played = e["seq"], i + 1
            self._report(state)
        self._done = True
        self._report(state)

    async def _until(self, t: float) -> None:
        """Wait until the virtual clock reaches `t`, not counting time spent paused."""
        while True:
            await self._resumed.wait()
            now = self.clock.now()
            if now is None or now >= t:
                return
            await self._sleep(min((t - now) / self.speed, REPLAY_TICK_S))

    def _report(self, state: DashboardState) -> None:
        if self._done:
            state.status = FeedStatus(Connection.FINISHED, self.source, f"{len(self.events)} events")
            return
        connection = Connection.PAUSED if self.paused else Connection.REPLAYING
        state.status = FeedStatus(connection, self.source, f"{self._played}/{len(self.events)} events "
                                  f"at {self.speed:g}x")


def _envelope_error(record: object) -> str | None:
    """What is wrong with a record's envelope (seq, t, instance, kind), or None."""
    if not isinstance(record, dict):
        return "not a JSON object"
    for key, kind in ENVELOPE.items():
        if not isinstance(record.get(key), kind) or isinstance(record.get(key), bool):
            return f"no valid {key!r}"
    return None


async def _sse_records(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The event records of a server-sent-events stream (one `data:` line each); a line that is
    not a record is skipped rather than ending the stream."""
    async for line in lines:
        if not line.startswith("data:"):
            continue
        try:
            record = json.loads(line[5:].strip())
        except ValueError:
            continue
        if _envelope_error(record) is None:
            yield record


def _why(e: Exception) -> str:
    if isinstance(e, httpx.HTTPStatusError):
        code = e.response.status_code
        if code in (401, 403):
            return f"HTTP {code}: the node wants its admin key; pass --api-key ADMIN_KEY"
        return f"HTTP {code} from {e.request.url.path}"
    if isinstance(e, httpx.ConnectError):
        return "cannot connect (is `talaria up` running there?)"
    if isinstance(e, ValueError):
        return NOT_TALARIA
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _is_local(url: str) -> bool:
    return (urlsplit(url).hostname or "") in LOOPBACK
