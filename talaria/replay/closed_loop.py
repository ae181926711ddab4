"""The paper's fixed closed-loop replay (App. A) against a live OpenAI-compatible server.

Fixed replay holds, per session, the request bodies, the call order and the tool gaps constant
across the configurations being compared, so only the server differs and agent paths cannot
diverge. It is closed-loop: all sessions start together, and a session's next call is released
after its previous call completes plus that call's recorded gap (capped; the paper caps at 10 s).
Global interleaving therefore follows the server's completion times, as it would with real agents.
A body may instead be a function of the previous call's result, built when that result is in: a
synthesized prompt that repeats the previous output (`talaria replay` without trace bodies). Such
bodies stay fixed across configurations only as far as the server's greedy output does.

Every time is on the injected `clock` (default `time.monotonic`), and waiting goes through the
injected `sleep`, so a test can drive the replay in virtual time. TTFT is schedule-aware: from the
call's intended enqueue (previous response + capped gap) to its first content chunk, so replay-side
delays count against the server as they would against an agent; `request_ttft_s` is the
request-local variant (from the send). SCT runs from a session's first intended enqueue to its last
response. Percentiles are nearest-rank, as in the paper.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

# Streaming flags added to every body: TTFT needs the first chunk, the usage needs the last one.
STREAM_FLAGS = {"stream": True, "stream_options": {"include_usage": True}}
# A cold-pool call may wait rounds before its first token: generous between chunks, quick to connect.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
NO_RESPONSE = 0  # CallResult.status when no HTTP response arrived (refused, reset, timed out)
ERROR_BODY_CHARS = 500  # how much of a non-JSON error body is kept


@dataclass(frozen=True, slots=True)
class ReplayCall:
    """One model call of a session: sent verbatim (plus the streaming flags) once its gap elapses."""

    # request body (model, prompt or messages, max_tokens, ignore_eos, temperature, session_id), or a
    # function that builds it from the previous call's result (None for the first call)
    body: dict[str, Any] | Callable[[CallResult | None], dict[str, Any]]
    gap_before_s: float  # tool gap after the previous response; for the first call, the offset from the start
    endpoint: str = "/v1/completions"  # path under the base URL (or "/v1/chat/completions")

    def __post_init__(self) -> None:
        if not self.gap_before_s >= 0:  # also rejects NaN
            raise ValueError(f"gap_before_s must be >= 0 seconds, got {self.gap_before_s}")
        if not self.endpoint.startswith("/"):
            raise ValueError(f'endpoint must be a path starting with "/", got {self.endpoint!r}')


@dataclass(frozen=True, slots=True)
class ReplaySession:
    """An agent session: its calls run one after another, each after the previous one's response."""

    session_id: str  # names the session in results (the bodies carry the server-side session_id)
    calls: tuple[ReplayCall, ...]  # in order


@dataclass(frozen=True, slots=True)
class CallResult:
    """What happened to one call, on the replay's clock."""

    session_id: str
    index: int  # position of the call in its session
    intended_s: float  # intended enqueue: previous response (or replay start) + capped gap
    sent_s: float  # when the request went out (>= intended_s)
    first_token_s: float | None  # first chunk carrying text; None when no text came
    done_s: float  # the response ended, normally or not
    status: int  # HTTP status; NO_RESPONSE (0) when none arrived
    text: str  # generated text, concatenated from the stream
    usage: dict[str, Any] | None  # the usage chunk (prompt, completion and cached tokens)
    error: str | None  # an HTTP error body, an in-stream error or a transport error; None on success

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def ttft_s(self) -> float | None:
        """Schedule-aware TTFT: first token - intended enqueue (the paper's default)."""
        return None if self.first_token_s is None else self.first_token_s - self.intended_s

    @property
    def request_ttft_s(self) -> float | None:
        """Request-local TTFT: first token - send."""
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ttft_s": self.ttft_s, "request_ttft_s": self.request_ttft_s}


@dataclass(frozen=True, slots=True)
class SessionResult:
    session_id: str
    calls: tuple[CallResult, ...]  # in call order
    sct_s: float  # session completion time: first call's intended enqueue -> last response

    def to_dict(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "sct_s": self.sct_s, "calls": [c.to_dict() for c in self.calls]}


@dataclass(frozen=True, slots=True)
class ReplayResult:
    sessions: tuple[SessionResult, ...]  # in the order the sessions were given
    wall_s: float  # replay start -> last session done

    @property
    def calls(self) -> list[CallResult]:
        return [c for s in self.sessions for c in s.calls]

    def summary(self) -> dict[str, Any]:
        """Counts, SCT sum/p50/p95 and schedule-aware TTFT p50/p95 (None where nothing to rank)."""
        sct = [s.sct_s for s in self.sessions]
        ttft = [c.ttft_s for c in self.calls if c.ttft_s is not None]

        def rank(values: list[float], q: float) -> float | None:
            return percentile(values, q) if values else None

        return {"sessions": len(self.sessions), "calls": len(self.calls),
                "errors": sum(not c.ok for c in self.calls), "wall_s": self.wall_s,
                "sct_sum_s": sum(sct), "sct_p50_s": rank(sct, 50), "sct_p95_s": rank(sct, 95),
                "ttft_p50_s": rank(ttft, 50), "ttft_p95_s": rank(ttft, 95)}

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "sessions": [s.to_dict() for s in self.sessions]}


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least q% of the values at or below it.

    `q` is in percent (50, 95); q = 0 gives the minimum. Always one of the values, never an
    interpolation, so a p95 of 20 sessions is the 19th smallest SCT, as the paper reports it."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q is a percentage in [0, 100], got {q}")
    rank = max(1, math.ceil(q * len(ordered) / 100))  # q * n first: 70 * 10 / 100 is exactly 7
    return ordered[rank - 1]


async def replay(
    base_url: str,
    sessions: Sequence[ReplaySession],
    *,
    gap_cap_s: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    client: httpx.AsyncClient | None = None,
    on_call: Callable[[CallResult], None] | None = None,
) -> ReplayResult:
    """Replay `sessions` closed-loop against the server at `base_url` (its root, e.g.
    http://127.0.0.1:8000) and return every call's timing and text.

    A failed call (non-200, an error in the stream, a transport error) is recorded, never raised,
    and its session goes on: fixed replay keeps the call order whatever the server does. `on_call`
    sees each result as it completes (progress, live tables). Without a `client`, one is made with
    DEFAULT_TIMEOUT and no connection limit, and closed at the end."""
    if not gap_cap_s >= 0:
        raise ValueError(f"gap_cap_s must be >= 0 seconds, got {gap_cap_s}")
    ids = [s.session_id for s in sessions]
    if len(set(ids)) != len(ids):
        raise ValueError(f"session ids must be unique; repeated: {sorted({i for i in ids if ids.count(i) > 1})}")
    http = client or httpx.AsyncClient(timeout=DEFAULT_TIMEOUT,
                                       limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
    root = base_url.rstrip("/")
    try:
        start = clock()
        runs = [_session(http, root, s, start, gap_cap_s, clock, sleep, on_call) for s in sessions]
        results = await asyncio.gather(*runs)
        wall = clock() - start
    finally:
        if client is None:
            await http.aclose()
    return ReplayResult(tuple(results), wall)


def replay_sync(base_url: str, sessions: Sequence[ReplaySession], **kwargs: Any) -> ReplayResult:
    """`replay` on a fresh event loop, for scripts and synchronous tests; same keyword arguments."""
    return asyncio.run(replay(base_url, sessions, **kwargs))


async def _session(http: httpx.AsyncClient, root: str, session: ReplaySession, start: float, gap_cap_s: float,
                   clock: Callable[[], float], sleep: Callable[[float], Awaitable[Any]],
                   on_call: Callable[[CallResult], None] | None) -> SessionResult:
    results: list[CallResult] = []
    ready = start  # invariant: the previous call's done_s (the replay start before the first call)
    for index, call in enumerate(session.calls):
        intended = ready + min(call.gap_before_s, gap_cap_s)
        # built before the gap, so building it does not delay the send
        body = call.body(results[-1] if results else None) if callable(call.body) else call.body
        delay = intended - clock()
        if delay > 0:
            await sleep(delay)
        result = await _send(http, root + call.endpoint, body, session.session_id, index, intended, clock)
        results.append(result)
        if on_call is not None:
            on_call(result)
        ready = result.done_s
    sct = results[-1].done_s - results[0].intended_s if results else 0.0
    return SessionResult(session.session_id, tuple(results), sct)


async def _send(http: httpx.AsyncClient, url: str, body: dict[str, Any], session_id: str, index: int,
                intended: float, clock: Callable[[], float]) -> CallResult:
    """Stream one call; whatever goes wrong ends up in the result's status and error."""
    sent = clock()
    first: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    status, error = NO_RESPONSE, None
    try:
        async with http.stream("POST", url, json={**body, **STREAM_FLAGS}) as response:
            status = response.status_code
            if status != 200:
                error = _error_text(await response.aread())
            else:
                finished = False
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, event names
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        finished = True
                        break
                    chunk = json.loads(data)
                    if chunk.get("error") is not None:
                        error = _error_text(data.encode())
                        break
                    text = _chunk_text(chunk)
                    if text:
                        if first is None:
                            first = clock()
                        parts.append(text)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                if error is None and not finished:
                    error = "the stream ended before data: [DONE]"
    except (httpx.HTTPError, OSError) as e:
        error = f"{type(e).__name__}: {e}".rstrip(": ")
    except ValueError as e:  # a chunk that is not JSON
        error = f"malformed stream chunk: {e}"
    return CallResult(session_id, index, intended, sent, first, clock(), status, "".join(parts), usage, error)


def _chunk_text(chunk: dict[str, Any]) -> str:
    """The text a chunk carries: `choices[].text` (completions) or `choices[].delta.content` (chat)."""
    out = []
    for choice in chunk.get("choices") or ():
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            out.append(text)
    return "".join(out)


def _error_text(raw: bytes) -> str:
    """The OpenAI error message when the body is one, else the start of the body."""
    try:
        message = json.loads(raw)["error"]["message"]
        if isinstance(message, str):
            return message
    except (ValueError, KeyError, TypeError):
        pass
    return raw.decode(errors="replace")[:ERROR_BODY_CHARS] or "(empty error body)"
