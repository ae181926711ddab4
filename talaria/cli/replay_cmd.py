"""`talaria replay`: the paper's fixed closed-loop replay (App. A) of a trace against a live server.

The engine is `talaria.replay.closed_loop`; this module only turns trace calls into replay calls and
reports. A call with a trace `body` sends it verbatim, with the fixed-output fields forced. A call
without one gets a synthesized prompt with the call's token structure for a byte-level tokenizer
(one ASCII character, one token): the first `reused_tokens` characters of the previous prompt, or
of the previous prompt plus the previous response as received when the reuse reaches into the
output, then new ASCII text up to `prompt_tokens`. The replay is closed-loop, so that response is
in when the next body is built (a `ReplayCall` body may be a function of the previous result).
Counts are exact for `/v1/completions` on a byte-level tokenizer; the chat endpoint adds the chat
template's tokens, another tokenizer merges bytes, and a response with non-ASCII text counts
characters rather than bytes.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import httpx

from talaria.cli.progress import ProgressPrinter
from talaria.contracts.trace import TraceCall, TraceError, read_trace, sessions
from talaria.replay import closed_loop
from talaria.replay.closed_loop import (
    CallResult,
    ReplayCall,
    ReplayResult,
    ReplaySession,
)

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
FILLER = "abcdefghijklmnopqrstuvwxyz    "  # ASCII only: one character is one byte-level token


class PromptSynthesizer:
    """One session's synthesized prompts; remembers the last one, which the next call reuses."""

    def __init__(self, session: str) -> None:
        self.session = session
        self.last_prompt = ""

    def prompt(self, call: TraceCall, previous: CallResult | None) -> str:
        """`call.prompt_tokens` characters, of which the first `call.reused_tokens` repeat the
        previous prompt (plus the previous response text, when the reuse reaches into it)."""
        context = self.last_prompt
        if call.reused_tokens > len(context) and previous is not None:
            context += previous.text
        head = context[:call.reused_tokens]  # shorter only when the response was cut short
        after = context[len(head)] if len(context) > len(head) else None
        self.last_prompt = head + _new_text(f"{self.session}/{call.index}", call.prompt_tokens - len(head), after)
        return self.last_prompt


def _new_text(seed: str, n: int, avoid: str | None) -> str:
    """`n` deterministic ASCII characters whose first is not `avoid`, so the common prefix with the
    previous context is exactly the reused part."""
    text = "".join(random.Random(seed).choices(FILLER, k=n))
    if text and text[0] == avoid:
        text = ("b" if avoid == "a" else "a") + text[1:]
    return text


def _forced(call: TraceCall) -> dict[str, Any]:
    """The fields every body carries: a fixed, greedy output length and the trace's session."""
    # at least 1, as the simulator sends: servers reject max_tokens = 0
    return {"max_tokens": max(1, call.completion_tokens), "ignore_eos": True, "temperature": 0,
            "session_id": call.session}


def replay_call(call: TraceCall, synth: PromptSynthesizer, endpoint: str) -> ReplayCall:
    """The replay call for one trace call. A trace body picks its endpoint by its shape (messages:
    chat, prompt: completions); `endpoint` is for synthesized bodies and bodies with neither."""
    if call.body is not None:
        path = ENDPOINTS["chat" if "messages" in call.body else "completions" if "prompt" in call.body else endpoint]
        forced = _forced(call)
        if "max_completion_tokens" in call.body:  # chat's newer name wins over max_tokens: force it too
            forced["max_completion_tokens"] = forced["max_tokens"]
        return ReplayCall({**call.body, **forced}, call.gap_s, path)

    def build(previous: CallResult | None) -> dict[str, Any]:
        text = synth.prompt(call, previous)
        payload = {"messages": [{"role": "user", "content": text}]} if endpoint == "chat" else {"prompt": text}
        return {"model": call.model, **payload, **_forced(call)}

    return ReplayCall(build, call.gap_s, ENDPOINTS[endpoint])


def replay_sessions(calls: list[TraceCall], endpoint: str) -> list[ReplaySession]:
    out = []
    for sid, seq in sessions(calls).items():
        synth = PromptSynthesizer(sid)
        out.append(ReplaySession(sid, tuple(replay_call(c, synth, endpoint) for c in seq)))
    return out


async def _run(root: str, plan: list[ReplaySession], models: set[str], api_key: str | None, gap_cap_s: float,
               on_call: Callable[[CallResult], None]) -> ReplayResult:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=closed_loop.DEFAULT_TIMEOUT, limits=limits, headers=headers) as http:
        await _probe(http, root, models)
        return await closed_loop.replay(root, plan, gap_cap_s=gap_cap_s, client=http, on_call=on_call)


async def _probe(http: httpx.AsyncClient, root: str, models: set[str]) -> None:
    """Fail before the replay when the server is not there or refuses the key; warn about models
    it does not list (their calls would all fail)."""
    try:
        r = await http.get(root + "/v1/models", timeout=10.0)
    except (httpx.HTTPError, OSError) as e:
        raise click.ClickException(f"cannot reach {root}: {type(e).__name__}: {e} "
                                   "(is the server up? `talaria up` starts one)") from None
    if r.status_code in (401, 403):
        raise click.ClickException(f"{root} refused the request (HTTP {r.status_code}); pass its key with --api-key")
    try:
        served = {m["id"] for m in r.json()["data"]}
    except (ValueError, KeyError, TypeError):
        return  # not every OpenAI-compatible server lists its models; the calls will tell
    missing = sorted(models - served)
    if missing:
        click.echo(f"talaria replay: warning: {root} does not list {', '.join(missing)} "
                   f"(it serves {', '.join(sorted(served)) or 'nothing'}); those calls will fail", err=True)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def table(summary: dict[str, Any]) -> str:
    rows = [("sessions", str(summary["sessions"])), ("calls", str(summary["calls"])),
            ("errors", str(summary["errors"])), ("SCT sum", _seconds(summary["sct_sum_s"])),
            ("SCT p50", _seconds(summary["sct_p50_s"])), ("SCT p95", _seconds(summary["sct_p95_s"])),
            ("TTFT p50 (schedule-aware)", _seconds(summary["ttft_p50_s"])),
            ("TTFT p95 (schedule-aware)", _seconds(summary["ttft_p95_s"])), ("wall", _seconds(summary["wall_s"]))]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v:>12}" for k, v in rows)


@click.command()
@click.option("--url", required=True, help="The server's root or /v1 URL, e.g. http://127.0.0.1:8000.")
@click.option("--trace", "trace_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Trace JSONL (docs/trace-format.md), e.g. from `talaria trace gen`.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the summary and every call's timing and text here.")
@click.option("--gap-cap-s", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Cap on each tool gap (and session start offset), as in the paper.")
@click.option("--endpoint", type=click.Choice(sorted(ENDPOINTS)), default="completions", show_default=True,
              help="Where synthesized bodies go (a trace body with messages goes to chat, with a prompt to completions).")
@click.option("--api-key", help="Sent as 'Authorization: Bearer KEY' (the server's [server] api_key).")
def replay(url: str, trace_path: Path, json_path: Path | None, gap_cap_s: float, endpoint: str,
               api_key: str | None) -> None:
    """Replay a trace closed-loop against a live Talaria or OpenAI-compatible server: SCT and TTFT.

    All sessions start together (plus their start offsets); a session's next call is sent when the
    previous response is in and its recorded gap has elapsed, with the trace's token counts, a fixed
    output length (ignore_eos) and greedy decoding, so only the server differs between runs.
    """
    root = url.rstrip("/").removesuffix("/v1")
    if not root.startswith(("http://", "https://")):
        raise click.ClickException(f"--url {url!r} is not an http(s) URL; e.g. http://127.0.0.1:8000")
    try:
        calls = read_trace(trace_path)
    except (TraceError, OSError, UnicodeDecodeError) as e:
        raise click.ClickException(f"bad trace: {e}") from None
    if not calls:
        raise click.ClickException(f"{trace_path} has no calls")
    plan = replay_sessions(calls, endpoint)
    progress = ProgressPrinter(sys.stderr)  # the stream now, not the one at import
    remaining = {s.session_id: len(s.calls) for s in plan}
    total, done = len(plan), 0

    def on_call(result: CallResult) -> None:
        nonlocal done
        remaining[result.session_id] -= 1
        if remaining[result.session_id] == 0:
            done += 1
            progress("talaria replay: sessions done", done, total)

    click.echo(f"talaria replay: {total} sessions, {len(calls)} calls -> {root}", err=True)
    progress("talaria replay: sessions done", 0, total)
    result = asyncio.run(_run(root, plan, {c.model for c in calls}, api_key, gap_cap_s, on_call))
    summary = result.summary()
    failed = [c for c in result.calls if not c.ok]
    if failed:
        first = failed[0]
        click.echo(f"talaria replay: {len(failed)} call(s) failed; first: session {first.session_id} call "
                   f"{first.index}: HTTP {first.status}: {first.error}", err=True)
    click.echo(table(summary))
    if json_path is not None:
        out = {"url": root, "trace": str(trace_path), "gap_cap_s": gap_cap_s, "endpoint": endpoint,
               **result.to_dict()}
        try:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(out, indent=2))
        except OSError as e:
            raise click.ClickException(f"cannot write {json_path}: {e}") from None
