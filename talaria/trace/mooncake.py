"""Mooncake's conversation trace as sessions, rebuilt from prefix-hash chains.

Mooncake (FAST'25) publishes one JSON object per request: `timestamp` (arrival, milliseconds from
the trace start), `input_length` and `output_length` (tokens) and `hash_ids`, one id per 512-token
block of the prompt, equal ids meaning equal content. It has no session ids, so sessions are
rebuilt: a request whose hash_ids begin with every complete block of an earlier request continues
that earlier request's session (the longest such request, the most recent on ties). An earlier
prompt's last block is usually partial and hashes differently once the conversation grows past
it, so only complete blocks (input_length // 512) identify a parent. Nearly every prompt opens with
the same first block (a shared system prompt), so a parent needs at least MIN_PARENT_BLOCKS
complete blocks: a one-block match says nothing about which conversation a request belongs to.

A request whose parent already has a successor forks the conversation; it starts a new session
(index 0 reuses nothing by the trace contract; its block_hashes still show the shared prefix).

The trace has no response times, so a continuation's gap_s is arrival minus its parent's arrival
(it includes the parent's own service time, unlike the paper's response -> enqueue gap); a first
call's gap_s is its arrival from the trace start. reused_tokens = 512 x the leading blocks shared
with the parent, capped at the prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from talaria.contracts.trace import TraceCall, TraceError

BLOCK_TOKENS = 512  # Mooncake hashes prompts in blocks of this many tokens
MIN_PARENT_BLOCKS = 2
MS = 1000.0  # timestamps are milliseconds


@dataclass(frozen=True, slots=True)
class MooncakeRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_mooncake(path: str | Path) -> list[MooncakeRequest]:
    """Every request of a Mooncake trace file, checked; a TraceError names the line and the field."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                d = json.loads(line)
            except ValueError as e:
                raise TraceError(f"{where}: not JSON ({e}); is this a Mooncake trace?") from None
            if not isinstance(d, dict):
                raise TraceError(f"{where}: a Mooncake request is a JSON object")
            try:
                req = MooncakeRequest(int(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                                      tuple(int(h) for h in d["hash_ids"]))
            except KeyError as e:
                raise TraceError(f"{where}: missing {e.args[0]!r}; Mooncake requests have timestamp, "
                                 "input_length, output_length and hash_ids") from None
            except (TypeError, ValueError):
                raise TraceError(f"{where}: timestamp, input_length, output_length must be integers "
                                 "and hash_ids a list of integers") from None
            if min(req.timestamp_ms, req.input_length, req.output_length) < 0:
                raise TraceError(f"{where}: negative timestamp or length")
            out.append(req)
    return out


def convert(requests: Iterable[MooncakeRequest], model: str = "mooncake") -> list[TraceCall]:
    """The requests as trace calls in arrival order, sessions rebuilt from hash chains."""
    reqs = sorted(requests, key=lambda r: r.timestamp_ms)  # stable: file order within a timestamp
    start = reqs[0].timestamp_ms if reqs else 0
    # Index of complete-block prefixes: a trie keyed by (node, block id), so finding the longest
    # earlier request that prefixes a prompt is one walk down its blocks, not one lookup per length.
    children: dict[tuple[int, int], int] = {}
    ends_at: dict[int, int] = {}  # trie node -> the most recent request whose complete blocks end there
    where: list[tuple[int, int]] = []  # request -> (session number, index in it)
    tail: list[int] = []  # session number -> its last request
    calls: list[TraceCall] = []
    for i, req in enumerate(reqs):
        parent = _longest_parent(req.hash_ids, children, ends_at)
        if parent is not None and tail[where[parent][0]] == parent:
            session, index = where[parent][0], where[parent][1] + 1
            shared = _shared_blocks(req.hash_ids, reqs[parent].hash_ids)
            reused = min(req.input_length, BLOCK_TOKENS * shared)
            gap_s = (req.timestamp_ms - reqs[parent].timestamp_ms) / MS
            tail[session] = i
        else:  # a new conversation, or a fork of one that has already moved on
            session, index, reused = len(tail), 0, 0
            gap_s = (req.timestamp_ms - start) / MS
            tail.append(i)
        where.append((session, index))
        calls.append(TraceCall(f"mc{session:05d}", index, model, req.input_length, reused,
                               req.output_length, gap_s, req.hash_ids))
        _index(req, i, children, ends_at)
    return calls


def _longest_parent(hashes: tuple[int, ...], children: dict[tuple[int, int], int],
                    ends_at: dict[int, int]) -> int | None:
    node, parent = 0, None
    for block in hashes:
        node = children.get((node, block), -1)
        if node < 0:
            break
        parent = ends_at.get(node, parent)
    return parent


def _index(req: MooncakeRequest, i: int, children: dict[tuple[int, int], int], ends_at: dict[int, int]) -> None:
    complete = req.input_length // BLOCK_TOKENS
    if complete < MIN_PARENT_BLOCKS:
        return
    node = 0
    for block in req.hash_ids[:complete]:
        node = children.setdefault((node, block), len(children) + 1)
    ends_at[node] = i  # overwrite: the most recent request wins ties


def _shared_blocks(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
