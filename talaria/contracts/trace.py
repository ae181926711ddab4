"""The trace contract: agent sessions as calls, one JSON object per line (docs/trace-format.md).

A trace is what `talaria trace gen` and `talaria trace convert` write, and what `talaria sim` and
`talaria replay` read. Each line is one call of one session; a session's calls appear in call order
(lines of different sessions may interleave). Token counts, not tokens: the simulator builds token
streams from them, and a live replay sends the optional `body` verbatim.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

TRACE_FORMAT = 1


class TraceError(ValueError):
    """A trace line that does not follow the format; the message names the line and the key."""


@dataclass(frozen=True, slots=True)
class TraceCall:
    session: str  # session id; unique within the trace
    index: int  # call index within the session, from 0, consecutive
    model: str  # the OpenAI "model" the call asks for
    prompt_tokens: int
    reused_tokens: int  # leading prompt tokens equal to the previous call's prompt + output (0 for index 0)
    completion_tokens: int  # fixed output length (replay sends max_tokens = this and ignore_eos)
    gap_s: float  # index 0: when the session starts, from the trace start; else the tool gap after the previous response
    block_hashes: tuple[int, ...] = ()  # optional: hash ids of the prompt's blocks (converted traces)
    body: dict[str, Any] | None = field(default=None, compare=False)  # optional: the request body for live replay

    def to_json(self) -> str:
        d = asdict(self)
        d["block_hashes"] = list(self.block_hashes)
        if not self.block_hashes:
            del d["block_hashes"]
        if self.body is None:
            del d["body"]
        return json.dumps(d, separators=(",", ":"))


REQUIRED = ("session", "index", "model", "prompt_tokens", "reused_tokens", "completion_tokens", "gap_s")
OPTIONAL = ("block_hashes", "body")


def parse_call(line: str, where: str) -> TraceCall:
    try:
        d = json.loads(line)
    except ValueError as e:
        raise TraceError(f"{where}: not JSON ({e})") from None
    if not isinstance(d, dict):
        raise TraceError(f"{where}: a trace line is a JSON object")
    unknown = set(d) - set(REQUIRED) - set(OPTIONAL)
    if unknown:
        raise TraceError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; keys are {', '.join(REQUIRED + OPTIONAL)}")
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    for k in ("index", "prompt_tokens", "reused_tokens", "completion_tokens"):
        if not isinstance(d[k], int) or isinstance(d[k], bool) or d[k] < 0:
            raise TraceError(f"{where}: {k} = {d[k]!r} must be a non-negative integer")
    if not isinstance(d["gap_s"], (int, float)) or isinstance(d["gap_s"], bool) or d["gap_s"] < 0:
        raise TraceError(f"{where}: gap_s = {d['gap_s']!r} must be a non-negative number")
    if d["reused_tokens"] > d["prompt_tokens"]:
        raise TraceError(f"{where}: reused_tokens = {d['reused_tokens']} exceeds prompt_tokens = {d['prompt_tokens']}")
    if d["index"] == 0 and d["reused_tokens"]:
        raise TraceError(f"{where}: a session's first call (index 0) reuses nothing; reused_tokens must be 0")
    return TraceCall(str(d["session"]), d["index"], str(d["model"]), d["prompt_tokens"], d["reused_tokens"],
                     d["completion_tokens"], float(d["gap_s"]), tuple(d.get("block_hashes", ())), d.get("body"))


def read_trace(path: str | Path | IO[str]) -> list[TraceCall]:
    """Every call of a trace file (or open text stream), checked line by line and per session."""
    if isinstance(path, (str, Path)):
        with open(path, encoding="utf-8") as f:
            return read_trace(f)
    name = getattr(path, "name", "<trace>")
    calls = [parse_call(line, f"{name}:{n}") for n, line in enumerate(path, 1) if line.strip()]
    for session, seq in sessions(calls).items():
        for i, c in enumerate(seq):
            if c.index != i:
                raise TraceError(f"{name}: session {session!r} has call index {c.index} where {i} was expected "
                                 "(a session's calls come in order, from 0)")
    return calls


def write_trace(calls: Iterable[TraceCall], out: IO[str]) -> int:
    n = 0
    for c in calls:
        out.write(c.to_json() + "\n")
        n += 1
    return n


def sessions(calls: Iterable[TraceCall]) -> dict[str, list[TraceCall]]:
    """Calls grouped by session, each in trace order; sessions in order of first appearance."""
    out: dict[str, list[TraceCall]] = {}
    for c in calls:
        out.setdefault(c.session, []).append(c)
    return out
