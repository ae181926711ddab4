"""Load: agent sessions against `talaria up`, with clients that honour Retry-After.

    python bench/load.py [--workload burst|patient] [--sessions N] [--quick] [--seed S] [--config PATH]
                         [--json PATH] [--capacity PATH] [--max-wall S] [--no-gate]
    python bench/load.py --workload patient --sweep 2,4,8,12 [--quick]   # capacity at the TTFT target

Two workloads, each fixed before any measurement (seeded; the same --seed gives the same sessions,
bodies, gaps and, through each call's `seed`, the same sampled tokens):

**burst** (the first one):
* Mix: of every 10 sessions 2 use `smollm2` (hot-0) and 4 each `tiny-llama` and `tiny-qwen3`
  (cold-0, TP=2, the two models take turns in rounds). Measured alone on the 2-core VM, one SmolLM2
  call (a 200-token prompt, 24 tokens out) takes 1.9 s and 16 concurrent fresh ones 11 s (~1.4
  calls/s); 32 concurrent tiny calls take 3.5 s (~9 calls/s). A fifth of the sessions on SmolLM2 was
  to keep both instances busy for about as long, and a 200-session run under 10 minutes (it takes
  13-15: SmolLM2's prompts grow to ~2,000 tokens, and its calls then run far slower than alone).
* A session: K turns of streamed `/v1/chat/completions` (`stream_options.include_usage`) with its
  `session_id`. The first call is the model's system prompt (the same for every session of a model,
  as an agent's is) and a task; each later call resends the whole history plus the previous reply as
  an assistant message and a tool result as a user message, after a tool gap (the tool running).
  `max_tokens` 16-32 per call, sampling at the default temperature with a per-call `seed`.
  SmolLM2 (8,192-token context, BPE): K 4-8, tool results 200-600 characters. The tiny models
  (2,048-token context, byte tokenizer: one token per byte) get K 4-6 and 60-150 characters, so the
  worst case fits (a reply counted at 3 tokens per token: a stray byte re-sent as U+FFFD); a plan
  that might not fit is refused before the server starts. Tool gaps 0.5-3 s, uniform.
* Arrival: all sessions start at once (N concurrent first calls), after a warm-up of 4 concurrent
  2-turn sessions per model that is not counted.
* The client: a refusal (below) is retried after its Retry-After (`retry-after-ms` when sent, as the
  OpenAI and Anthropic SDKs read it; default 2 s), at most 5 times.

**patient** (issue 33, "Overload that agents live through", as its report states it):
* 200 sessions, all on `smollm2`, 6 turns each, the session shape above (tool results 200-600
  characters, `max_tokens` 16-32); tool gaps 0.05-1.3 s, uniform.
* Arrival: within 3 s, each session's start uniform in [0, 3] s, after the same warm-up (SmolLM2's
  4 sessions only).
* The client is patient: on a refusal it sleeps the Retry-After it was given, at most 30 s, and
  retries the call up to 30 times.

For both: a refusal is a 429, or a 503 (529 under /v1/messages) with code `over_capacity`; the
client backs off on both, as the SDKs do. A session whose FIRST call is still refused after its
retries *gave up* (shed: a new session turned away). A session whose first call was answered 200 is
*admitted*; any later failure of one of its calls (refused after the retries, any other status, an
in-band stream error, a stream without `[DONE]`, an attempt not over within 180 s: queueing and
streaming included) is a *failed call of an admitted session*, and the session stops there. A
first call that fails with anything but a refusal is a server error, not shedding.

Measured: failed calls of admitted sessions; 429s to new sessions (first calls) and to admitted
ones (retried), 503 over-capacity refusals, and refusals per admitted session (its first call's
included: the wait in line); the admitted fraction; goodput (calls of admitted
sessions answered whole, per minute of the run); the longest wait from a session's start to its
admission; sessions in service at once (the most sessions between their first call's 200 and
their last call's end, exact from the records; a 1 s timeline also goes to the JSON); TTFT
p50/p95 from sending the answered attempt to the first delta with content (the role-only chunk
skipped; reasoning or tool-call deltas count); SCT p50/p95 (first attempt of the first call to the
end of the last call, retries and gaps included) of finished sessions; the PSS (psutil
`memory_full_info().pss`) of the supervisor and of each worker after warm-up and at the end; the
node's admission line and what it learned (`/talaria/telemetry` router.line, session_lengths).

Targets (issue 33), on the default config. Wrong results, which `--no-gate` does not excuse: a
failed call of an admitted session; a call failed with anything but a refusal the client gave up
on. Targets: admitted calls' TTFT p95 within 1.5 x the instances' `ttft_s`; every session admitted
(the admitted fraction 1: the clients follow Retry-After) and every admitted session finished;
goodput at least 80% of the node's capacity at its TTFT target for the same workload, read from
the sweep's JSON (no sweep, or a --quick one: not judged, a miss); PSS growth below 20% for the
supervisor and for each worker (each alone: a leak in the 80 MB supervisor would vanish in the 3
GB total). The patient workload adds: each session admitted within 10 minutes of its start, and at
most 3 refusals per admitted session on average.

**--sweep N1,N2,...**: the node's capacity at its TTFT target. One server, started with
`[router] overload = "queue"`, `max_queued = 4096`, `queue_timeout_s = 600` (every call held until
an instance takes it, none refused: the admission line would otherwise keep the concurrency below
N); after the warm-up, for each N in turn, N sessions of the workload run closed-loop (a session
that ends is replaced at once) for `SWEEP.ramp_s` (20 s), then `SWEEP.window_s` (45 s) are
measured: TTFT p50/p95, from a call's first attempt, and calls per minute of the calls sent in the
window; those calls get `SWEEP.tail_s` (30 s) more to end, and one still without a first token
then counts with its wait so far. The capacity is the largest N whose TTFT p95 is within `ttft_s`
(the target itself, not 1.5x) with no call failed, and its calls per minute the goodput the
workload is judged against; its resolution is the sweep's steps. Written to
bench/results/load-sweep-WORKLOAD.json; exits 1 when no N met the target. `--quick` shortens the
points (5 s, 15 s, 15 s), to see the sweep run, and writes load-sweep-WORKLOAD-quick.json, which
is not a capacity.

`--max-wall S` cuts a run's sessions off S seconds after they start, for a run that cannot finish in
the time there is: the sessions still running are *cut off* (a missed target, not a failure; a call
cut off in flight counts neither as answered nor as failed) and everything else is reported as
measured until then.

Progress goes to stderr, the table to stdout, everything to the JSON (default
bench/results/load-WORKLOAD.json) and the server log beside it. The verdict (bench/report.py's
gate) is printed last: exits 1 when a target is missed (unless --no-gate), and on a wrong result
whatever --no-gate says.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

import httpx
import psutil
from report import (  # bench/report.py, beside this script
    ProgressLog,
    add_gate_flag,
    environment,
    gate,
    render,
    write_json,
)
from server import start_server, stop_server, wait_healthy  # bench/server.py

from talaria.replay import percentile

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "talaria" / "talaria.toml"
RESULTS = Path("bench/results")


@dataclass(frozen=True, slots=True)
class ModelShape:
    share: int  # sessions of every 10
    context: int  # tokens
    turns: tuple[int, int]  # K, uniform
    tool_chars: tuple[int, int]  # a tool result's length, uniform


MODELS = {"smollm2": ModelShape(2, 8192, (4, 8), (200, 600)),
          "tiny-llama": ModelShape(4, 2048, (4, 6), (60, 150)),
          "tiny-qwen3": ModelShape(4, 2048, (4, 6), (60, 150))}


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    models: dict[str, ModelShape]
    sessions: int  # the default --sessions
    gap_s: tuple[float, float]  # a tool gap, uniform
    arrival_s: float  # sessions start uniform in [0, arrival_s]
    retries: int  # on a refusal (429, or 503/529 over capacity), after its Retry-After
    retry_cap_s: float | None  # a Retry-After longer than this is slept this long (None: as told)
    admit_within_s: float | None  # target: every session admitted this soon after its start (None: none)
    max_429_per_admitted: float | None  # target: refusals per admitted session, on average (None: none)


WORKLOADS = {
    "burst": Workload("burst", MODELS, 200, (0.5, 3.0), 0.0, 5, None, None, None),
    "patient": Workload("patient", {"smollm2": ModelShape(10, 8192, (6, 6), (200, 600))}, 200, (0.05, 1.3), 3.0,
                        30, 30.0, 600.0, 3.0),
}
SYSTEM = ("You are a coding agent working in a git checkout. Use the tools to read and edit files, run "
          "the tests after every change, and answer briefly.")  # 160 bytes with the model's name
MAX_TOKENS = (16, 32)
OVER_CAPACITY = (503, 529)  # with code over_capacity: backed off and retried as a 429 is (the SDKs retry both)
CALL_DEADLINE_S = 180.0  # an attempt not over this long (held at the gateway or streaming) fails
TEMPLATE_TOKENS = 40  # per message, an upper bound on what a chat template adds
WARMUP_SESSIONS, WARMUP_TURNS = 4, 2  # per model
TARGETS = {"ttft_p95_x_target": 1.5, "goodput_of_capacity": 0.8, "pss_growth": 0.20}


@dataclass(frozen=True, slots=True)
class SweepTiming:
    ramp_s: float  # closed-loop sessions settle
    window_s: float  # then the calls sent in this window are measured
    tail_s: float  # and get this long after it to answer; the rest are cut off (counted with their wait so far)
    pause_s: float  # between points: cut-off calls leave the node


SWEEP = SweepTiming(20.0, 45.0, 30.0, 5.0)
SWEEP_QUICK = SweepTiming(5.0, 15.0, 15.0, 2.0)  # --quick: to see it run, not a capacity


@dataclass(frozen=True, slots=True)
class Turn:
    tool_result: str  # appended before this call (unused on the first)
    gap_s: float  # the tool's run before this call (0 on the first)
    max_tokens: int
    seed: int


@dataclass(frozen=True, slots=True)
class SessionPlan:
    id: str
    model: str
    task: str
    turns: tuple[Turn, ...]
    start_s: float = 0.0  # its first call, after the run's start

    def worst_prompt_tokens(self) -> int:
        """An upper bound on the last call's prompt and output: text bytes, replies at 3 per token."""
        text = len(system_prompt(self.model).encode()) + len(self.task.encode())
        text += sum(len(t.tool_result.encode()) for t in self.turns[1:])
        replies = sum(3 * t.max_tokens for t in self.turns[:-1])
        return text + replies + TEMPLATE_TOKENS * 2 * len(self.turns) + self.turns[-1].max_tokens


def system_prompt(model: str) -> str:
    return f"{SYSTEM} Model: {model}."


def tool_result(rng: random.Random, chars: int) -> str:
    """Something shaped like a grep over source files, `chars` long."""
    lines = []
    while sum(len(x) + 1 for x in lines) < chars:
        lines.append(f"src/pkg_{rng.randrange(40)}/mod_{rng.randrange(99)}.py:{rng.randrange(1, 900)}: "
                     f"def f{rng.randrange(10**4)}(x, y): return x {rng.choice('+-*')} y")
    return "\n".join(lines)[:chars]


def mix(n: int, rng: random.Random, models: dict[str, ModelShape] = MODELS) -> list[str]:
    """`n` sessions' models in the shares of `models` (by rounds of 10), shuffled."""
    deck = [m for m, shape in models.items() for _ in range(shape.share)]
    picked = [deck[i % len(deck)] for i in range(n)]
    rng.shuffle(picked)
    return picked


def plan_sessions(models: list[str], seed: int, prefix: str = "s", max_turns: int | None = None,
                  workload: Workload = WORKLOADS["burst"]) -> list[SessionPlan]:
    rng = random.Random(seed)
    plans = []
    for i, model in enumerate(models):
        shape = workload.models.get(model) or MODELS[model]
        k = min(rng.randint(*shape.turns), max_turns or shape.turns[1])
        turns = tuple(Turn("" if j == 0 else tool_result(rng, rng.randint(*shape.tool_chars)),
                           0.0 if j == 0 else round(rng.uniform(*workload.gap_s), 3),
                           rng.randint(*MAX_TOKENS), rng.randrange(2**31)) for j in range(k))
        task = f"Task {i}: the test tests/test_mod_{rng.randrange(99)}.py fails; find the cause and fix it."
        start = round(rng.uniform(0.0, workload.arrival_s), 3) if workload.arrival_s else 0.0
        plans.append(SessionPlan(f"{prefix}-{seed}-{i}-{model}", model, task, turns, start))
    return plans


# ---- one session, as an agent client runs it ----------------------------------------------------

class Outcome(Enum):
    FINISHED = "finished"  # every call succeeded
    SHED = "shed"  # its first call was refused retries + 1 times (429, or 503 over capacity): it gave up
    REFUSED = "refused"  # its first call failed with anything else: a server error, not shedding
    FAILED = "failed"  # admitted, then a call failed
    CUT_OFF = "cut off"  # still running at --max-wall: neither finished nor failed


@dataclass(slots=True)
class CallRecord:
    session: str
    index: int
    model: str
    gap_s: float = 0.0  # the tool gap before it (a gap under the router's lease_s returns on a lease)
    sent_s: float = 0.0  # first attempt
    done_s: float = 0.0
    attempts: int = 0
    n429: int = 0
    refused: int = 0  # 429s, and 503s or 529s over capacity, each retried after its Retry-After
    gave_up: bool = False  # refused retries + 1 times: the client stopped asking
    status: int | None = None  # of the last attempt
    answered_s: float | None = None  # the 200's headers arrived: the router placed the call
    ttft_s: float | None = None  # the answered attempt sent -> its first content delta
    first_token_s: float | None = None  # when that delta arrived (the sweep's TTFT is from sent_s, retries included)
    deltas: int = 0  # content deltas received (a call cut short: how far it got)
    last_delta_s: float | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    refusal: str | None = None  # the last non-200 body
    text: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True)
class SessionRecord:
    id: str
    model: str
    turns: int
    outcome: Outcome | None = None
    start_s: float = 0.0
    admitted_s: float | None = None
    end_s: float | None = None
    calls: list[CallRecord] = field(default_factory=list)


class Client:
    """Runs sessions on one httpx client; times are seconds since `t0` (perf_counter)."""

    def __init__(self, http: httpx.AsyncClient, base_url: str, t0: float,
                 workload: Workload = WORKLOADS["burst"]) -> None:
        self.http, self.url, self.t0, self.workload = http, base_url + "/v1/chat/completions", t0, workload
        self.sessions: list[SessionRecord] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def session(self, plan: SessionPlan, delay: bool = True) -> SessionRecord:
        if delay and plan.start_s:
            await asyncio.sleep(plan.start_s)
        rec = SessionRecord(plan.id, plan.model, len(plan.turns), start_s=self.now())
        self.sessions.append(rec)
        messages = [{"role": "system", "content": system_prompt(plan.model)}, {"role": "user", "content": plan.task}]
        for i, turn in enumerate(plan.turns):
            if i:
                await asyncio.sleep(turn.gap_s)
                messages.append({"role": "user", "content": f"<tool_result>\n{turn.tool_result}\n</tool_result>"})
            call = CallRecord(plan.id, i, plan.model, turn.gap_s, self.now())
            rec.calls.append(call)  # before it ends: the sampler sees its answer
            await self.call(plan, messages, turn, call)
            if i == 0 and call.answered_s is None:
                rec.outcome = Outcome.SHED if call.gave_up else Outcome.REFUSED
                return rec
            rec.admitted_s = call.answered_s if i == 0 else rec.admitted_s
            if not call.ok:
                rec.outcome, rec.end_s = Outcome.FAILED, call.done_s
                return rec
            messages.append({"role": "assistant", "content": call.text})
        rec.outcome, rec.end_s = Outcome.FINISHED, rec.calls[-1].done_s
        return rec

    async def call(self, plan: SessionPlan, messages: list[dict], turn: Turn, c: CallRecord) -> None:
        body = {"model": plan.model, "messages": messages, "max_tokens": turn.max_tokens, "seed": turn.seed,
                "stream": True, "stream_options": {"include_usage": True}, "session_id": plan.id}
        while True:
            c.attempts += 1
            try:
                async with asyncio.timeout(CALL_DEADLINE_S):
                    retry_after = await self._attempt(body, c)
            except TimeoutError:
                c.error = f"no end of the call within {CALL_DEADLINE_S:.0f} s (attempt {c.attempts})"
            except (httpx.HTTPError, ValueError) as exc:
                c.error = f"{type(exc).__name__}: {exc}"
            retries, cap = self.workload.retries, self.workload.retry_cap_s
            over_capacity = c.status in OVER_CAPACITY and "over_capacity" in (c.refusal or "")
            if c.status == 429 and c.error is None or over_capacity:
                c.n429 += c.status == 429
                c.refused += 1
                if c.refused <= retries:
                    c.error = None
                    await asyncio.sleep(retry_after if cap is None else min(cap, retry_after))
                    continue
                c.error, c.gave_up = f"{c.status} after {retries} retries", True
            c.done_s = self.now()
            return

    async def _attempt(self, body: dict, c: CallRecord) -> float:
        """One POST; returns Retry-After on a 429, else fills `c` (error on any failure)."""
        sent, c.status = self.now(), None
        async with self.http.stream("POST", self.url, json=body) as r:
            c.status = r.status_code
            if r.status_code != 200:
                c.refusal = (await r.aread()).decode(errors="replace")[:300]
                if r.status_code != 429:
                    c.error = f"HTTP {r.status_code}: {c.refusal}"
                if r.headers.get("retry-after-ms"):  # what the OpenAI and Anthropic SDKs read first
                    return float(r.headers["retry-after-ms"]) / 1000
                return float(r.headers.get("retry-after", 2))
            c.answered_s, done = self.now(), False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    c.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return 0.0
                if chunk.get("usage"):
                    u = chunk["usage"]
                    c.prompt_tokens, c.completion_tokens = u.get("prompt_tokens"), u.get("completion_tokens")
                    c.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    piece = delta.get("content") or ""
                    if piece or delta.get("reasoning_content") or delta.get("tool_calls"):
                        c.deltas, c.last_delta_s = c.deltas + 1, self.now()
                        if c.ttft_s is None:
                            c.ttft_s, c.first_token_s = c.last_delta_s - sent, c.last_delta_s
                    c.text += piece
                    c.finish_reason = choice.get("finish_reason") or c.finish_reason
            if not done:
                c.error = "the stream ended without [DONE]"
            return 0.0


# ---- the run ----------------------------------------------------------------------------------------

def processes(proc, config: Path) -> dict[str, psutil.Process]:
    """The supervisor and its workers, named by spawn order (instances in config order, ranks in order)."""
    sup = psutil.Process(proc.pid)
    workers = sorted((p for p in sup.children(recursive=True) if "resource_tracker" not in " ".join(p.cmdline())),
                     key=lambda p: (p.create_time(), p.pid))
    instances = tomllib.loads(config.read_text())["instances"]
    names = [f"{i['name']}/rank{r}" for i in instances for r in range(i.get("tp", 1))]
    if len(names) != len(workers):
        names = [f"worker-{p.pid}" for p in workers]
    return {"supervisor": sup, **dict(zip(names, workers))}


def pss(procs: dict[str, psutil.Process]) -> dict[str, dict]:
    out = {}
    for name, p in procs.items():
        try:
            out[name] = {"pid": p.pid, "pss_bytes": p.memory_full_info().pss}
        except psutil.Error as exc:  # a worker that restarted: its successor is another process
            out[name] = {"pid": p.pid, "pss_bytes": None, "error": f"{type(exc).__name__}"}
    return out


INSTANCE_KEYS = ("waiting", "running", "kv_pages_used", "kv_pages_total", "preemptions", "prefix_hit_tokens",
                 "host_restored_tokens")


def instance_rows(telemetry: dict) -> dict[str, dict]:
    """Per instance, from GET /talaria/telemetry: state, calls in flight, restarts and the snapshot's queue,
    KV and preemption counters."""
    out = {}
    for name, i in telemetry["instances"].items():
        stats = i.get("stats") or {}
        out[name] = {"state": i["state"], "in_flight": i["in_flight"], "restarts": i["restarts"],
                     **{k: stats.get(k) for k in INSTANCE_KEYS}}
    return out


async def drive(base_url: str, warmup: list[SessionPlan], plans: list[SessionPlan], procs, log,
                workload: Workload, max_wall_s: float | None = None) -> dict:
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=len(plans) + 32, max_keepalive_connections=len(plans) + 32)
    timeout = httpx.Timeout(CALL_DEADLINE_S, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http, \
            httpx.AsyncClient(timeout=5.0) as probe:
        warm = Client(http, base_url, t0, workload)
        await asyncio.gather(*(warm.session(p) for p in warmup))
        bad = [c.error for s in warm.sessions for c in s.calls if not c.ok]
        log(f"warm-up: {len(warmup)} sessions, {sum(len(s.calls) for s in warm.sessions)} calls, "
            f"{len(bad)} failed{': ' + bad[0] if bad else ''}")
        pss_warm = pss(procs)
        client, timeline = Client(http, base_url, time.perf_counter(), workload), []

        async def sample() -> None:
            while True:
                await asyncio.sleep(1.0)
                s = client.sessions
                placed = [bool(r.calls) and r.calls[0].answered_s is not None for r in s]
                row = {"t_s": round(client.now(), 1),
                       "in_service": sum(p and r.outcome is None for p, r in zip(placed, s)),
                       "waiting_first_call": sum(not p and r.outcome is None for p, r in zip(placed, s)),
                       "done": sum(r.outcome is not None for r in s)}
                try:
                    t = (await probe.get(base_url + "/talaria/telemetry")).json()
                    row["instances"] = instance_rows(t)
                    line = t["router"].get("line") or {}
                    row["line"] = {k: line.get(k) for k in ("waiting", "scale", "counts")}
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                    row["telemetry_error"] = f"{type(exc).__name__}: {exc}"
                timeline.append(row)
                if len(timeline) % 10 == 0:
                    insts = "; ".join(f"{n}: {i['running']} running, {i['waiting']} waiting, KV {i['kv_pages_used']}/"
                                      f"{i['kv_pages_total']}, {i['preemptions']} preempted"
                                      for n, i in row.get("instances", {}).items())
                    log(f"t={row['t_s']:.0f}s in service {row['in_service']}, waiting first call "
                        f"{row['waiting_first_call']} (line {row.get('line', {}).get('waiting')}), "
                        f"done {row['done']}/{len(plans)}; {insts}")

        sampler = asyncio.create_task(sample())
        try:
            async with asyncio.timeout(max_wall_s):
                await asyncio.gather(*(client.session(p) for p in plans))
        except TimeoutError:
            log(f"--max-wall {max_wall_s:g} s: the sessions still running are cut off")
        wall = client.now()
        for rec in client.sessions:
            rec.outcome = rec.outcome or Outcome.CUT_OFF
        sampler.cancel()
        await asyncio.sleep(2.0)  # let the last calls' bookkeeping settle
        pss_end = pss(procs)
        try:
            telemetry = (await probe.get(base_url + "/talaria/telemetry")).json().get("router")
        except (httpx.HTTPError, ValueError) as exc:
            telemetry = {"error": f"{type(exc).__name__}: {exc}"}
    return {"sessions": client.sessions, "wall_s": wall, "timeline": timeline, "pss_warm": pss_warm,
            "pss_end": pss_end, "router": telemetry}


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def pct(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def summarize(sessions: list[SessionRecord], wall_s: float | None = None) -> dict:
    calls = [c for s in sessions for c in s.calls]
    admitted = [s for s in sessions if s.admitted_s is not None]
    ok = [c for s in admitted for c in s.calls if c.ok and c.done_s]  # a call cut off by --max-wall never ended
    ttft = [c.ttft_s for c in ok if c.ttft_s is not None]
    sct = [s.end_s - s.start_s for s in sessions if s.outcome is Outcome.FINISHED]
    prompt = sum(c.prompt_tokens or 0 for c in ok)
    waits = [s.admitted_s - s.start_s for s in admitted]
    refusals_admitted = sum(c.refused for s in admitted for c in s.calls)  # a 503 over capacity counts as a 429
    return {
        "sessions": len(sessions), "admitted": len(admitted),
        "admitted_fraction": len(admitted) / len(sessions) if sessions else None,
        "finished": sum(s.outcome is Outcome.FINISHED for s in sessions),
        "shed": sum(s.outcome is Outcome.SHED for s in sessions),
        "refused_with_error": sum(s.outcome is Outcome.REFUSED for s in sessions),
        "cut_off": sum(s.outcome is Outcome.CUT_OFF for s in sessions),
        "admitted_unfinished": sum(s.outcome is not Outcome.FINISHED for s in admitted),
        "failed_calls_admitted": sum(not c.ok for s in admitted for c in s.calls),
        "failed_calls_not_refused": sum(not c.ok and not c.gave_up for c in calls),
        "new_session_429s": sum(s.calls[0].n429 for s in sessions),
        "admitted_session_429s": sum(c.n429 for s in admitted for c in s.calls[1:]),
        "over_capacity_refusals": sum(c.refused - c.n429 for c in calls),
        "mean_429_per_admitted": refusals_admitted / len(admitted) if admitted else None,
        "max_in_service": max_overlap([(s.admitted_s, s.end_s) for s in admitted if s.end_s is not None]),
        "calls": len(calls), "calls_ok": len(ok), "calls_without_content": sum(c.ttft_s is None for c in ok),
        "goodput_calls_per_min": len(ok) / wall_s * 60 if wall_s else None,
        "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95),
        "sct_p50_s": pct(sct, 50), "sct_p95_s": pct(sct, 95),
        "prompt_tokens": prompt, "cached_fraction": sum(c.cached_tokens or 0 for c in ok) / prompt if prompt else None,
        "first_call_wait_p95_s": pct(waits, 95), "first_call_wait_max_s": max(waits) if waits else None,
    }


def pss_growth(warm: dict, end: dict) -> dict:
    out = {}
    for name, w in warm.items():
        e = end.get(name, {})
        ratio = (e["pss_bytes"] / w["pss_bytes"] - 1) if w.get("pss_bytes") and e.get("pss_bytes") else None
        out[name] = {"warm_mib": (w.get("pss_bytes") or 0) / 2**20, "end_mib": (e.get("pss_bytes") or 0) / 2**20,
                     "growth": ratio}
    return out


def misses(s: dict, growth: dict, workload: Workload, ttft_target_s: float,
           capacity: dict | None) -> tuple[list[str], list[str]]:
    """(targets missed, wrong results) of a run's summary: see the module docstring. `capacity`: the
    sweep's result for this workload (None: not measured, so goodput is not judged, a miss)."""
    missed, wrong = [], []
    if s["failed_calls_admitted"]:
        wrong.append(f"{s['failed_calls_admitted']} failed calls of admitted sessions (target 0; errors in the JSON)")
    if s["failed_calls_not_refused"]:
        wrong.append(f"{s['failed_calls_not_refused']} calls failed with something other than a refusal the client "
                     f"gave up on (target 0)")
    if s["cut_off"]:
        missed.append(f"{s['cut_off']} sessions cut off by --max-wall: the run did not finish")
    if s["admitted_unfinished"]:
        missed.append(f"{s['admitted_unfinished']} admitted sessions did not finish (target 0)")
    bound = TARGETS["ttft_p95_x_target"] * ttft_target_s
    if s["ttft_p95_s"] is None or s["ttft_p95_s"] > bound:
        p95 = "-" if s["ttft_p95_s"] is None else f"{s['ttft_p95_s']:.2f}"
        missed.append(f"admitted calls' TTFT p95 {p95} s (target <= {bound:g} s, "
                      f"{TARGETS['ttft_p95_x_target']:g} x ttft_s)")
    if s["admitted"] < s["sessions"]:
        missed.append(f"admitted fraction {s['admitted_fraction']:.2f}: {s['admitted']} of {s['sessions']} sessions, "
                      f"{s['shed']} gave up after {workload.retries} retries (target: all; the clients follow "
                      f"Retry-After)")
    if workload.admit_within_s is not None and (s["first_call_wait_max_s"] or 0) > workload.admit_within_s:
        missed.append(f"a session waited {s['first_call_wait_max_s']:.0f} s to be admitted "
                      f"(target <= {workload.admit_within_s:.0f} s)")
    most = workload.max_429_per_admitted
    if most is not None and (s["mean_429_per_admitted"] is None or s["mean_429_per_admitted"] > most):
        mean = "-" if s["mean_429_per_admitted"] is None else f"{s['mean_429_per_admitted']:.2f}"
        missed.append(f"{mean} 429s per admitted session (target <= {most:g})")
    if capacity is None or capacity.get("capacity_calls_per_min") is None:
        missed.append(f"goodput {s['goodput_calls_per_min']:.1f} calls/min not judged: no capacity measured for "
                      f"the {workload.name} workload (run --sweep first)")
    elif s["goodput_calls_per_min"] < TARGETS["goodput_of_capacity"] * capacity["capacity_calls_per_min"]:
        missed.append(f"goodput {s['goodput_calls_per_min']:.1f} calls/min (target >= "
                      f"{TARGETS['goodput_of_capacity']:.0%} of the capacity, "
                      f"{capacity['capacity_calls_per_min']:.1f} calls/min at {capacity['capacity_sessions']} sessions)")
    for name, g in growth.items():
        if g["growth"] is None or g["growth"] >= TARGETS["pss_growth"]:
            missed.append(f"PSS of {name}: {g['warm_mib']:.0f} -> {g['end_mib']:.0f} MiB "
                          f"(target growth < {TARGETS['pss_growth']:.0%}; None: the process is gone)")
    return missed, wrong


def table(s: dict, per_model: dict, growth: dict, workload: Workload, ttft_target_s: float,
          capacity: dict | None) -> str:
    def f(v, scale=1.0, digits=2):
        return "-" if v is None else f"{v * scale:.{digits}f}"

    cap = capacity.get("capacity_calls_per_min") if capacity else None
    rows = [("metric", "value", "target")]
    for key, target in (("sessions", ""), ("admitted", "all"), ("finished", ""), ("shed", "0"), ("cut_off", "0"),
                        ("admitted_unfinished", "0"), ("failed_calls_admitted", "0"), ("failed_calls_not_refused", "0"),
                        ("new_session_429s", ""), ("admitted_session_429s", ""), ("over_capacity_refusals", ""),
                        ("max_in_service", ""), ("calls", ""), ("calls_ok", ""), ("calls_without_content", "")):
        rows.append((key, str(s[key]), target))
    rows.append(("admitted_fraction", f(s["admitted_fraction"]), "1.00"))
    most = workload.max_429_per_admitted
    rows.append(("mean_429_per_admitted", f(s["mean_429_per_admitted"]), "" if most is None else f"<= {most:g}"))
    rows.append(("goodput_calls_per_min", f(s["goodput_calls_per_min"], digits=1),
                 "-" if cap is None else f">= {TARGETS['goodput_of_capacity'] * cap:.1f} (capacity {cap:.1f})"))
    rows.append(("ttft_p50_s", f(s["ttft_p50_s"]), ""))
    rows.append(("ttft_p95_s", f(s["ttft_p95_s"]), f"<= {TARGETS['ttft_p95_x_target'] * ttft_target_s:g}"))
    for key in ("sct_p50_s", "sct_p95_s", "first_call_wait_p95_s"):
        rows.append((key, f(s[key]), ""))
    within = workload.admit_within_s
    rows.append(("first_call_wait_max_s", f(s["first_call_wait_max_s"]), "" if within is None else f"<= {within:g}"))
    rows.append(("cached_fraction", f(s["cached_fraction"]), ""))
    for model, m in per_model.items():
        rows.append((f"{model}: admitted/finished/shed", f"{m['admitted']}/{m['finished']}/{m['shed']}", ""))
        ttft = f"{f(m['ttft_p50_s'])}/{f(m['ttft_p95_s'])}"
        sct = f"{f(m['sct_p50_s'], digits=1)}/{f(m['sct_p95_s'], digits=1)}"
        rows.append((f"{model}: TTFT p50/p95, SCT p50/p95 s", f"{ttft}, {sct}", ""))
    for name, g in growth.items():
        rows.append((f"PSS {name}, MiB", f"{g['warm_mib']:.0f} -> {g['end_mib']:.0f} ({f(g['growth'], 100, 1)}%)",
                     "< 20%"))
    return render(rows)


def failed_calls(sessions: list[SessionRecord]) -> list[dict]:
    """Every failed call but a shed first call, with the calls of its model placed while it waited:
    many placed meanwhile means it was passed over, not that nothing could run."""
    calls = [c for s in sessions for c in s.calls]
    out = []
    for c in (c for s in sessions for c in s.calls if not c.ok and (s.admitted_s is not None or not c.gave_up)):
        meanwhile = [o for o in calls if o.model == c.model and o.session != c.session and o.answered_s is not None
                     and c.sent_s < o.answered_s < c.done_s]
        out.append(asdict(c) | {"text": c.text[:80], "placed_meanwhile": len(meanwhile),
                                "placed_meanwhile_within_1s": sum(o.answered_s - o.sent_s < 1.0 for o in meanwhile)})
    return out


def server_log_problems(path: Path, limit: int = 60) -> list[str]:
    keys = ("error", "traceback", "exception", "warning", "restart", "stall", "killed")
    lines = [x for x in path.read_text(errors="replace").splitlines() if any(k in x.lower() for k in keys)]
    return lines[:limit]


# ---- the capacity sweep ------------------------------------------------------------------------------

QUEUE_ROUTER = {"overload": '"queue"', "max_queued": "4096", "queue_timeout_s": "600.0"}


def queue_config(config: Path, out: Path) -> Path:
    """`config` with `[router] overload = "queue"` and room to hold every call as long as the SDKs wait
    (`QUEUE_ROUTER`): no call refused, so N sessions really are N at once."""
    lines, section = [], None
    for line in config.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            section = stripped
        elif section == "[router]" and stripped.split("=")[0].strip() in QUEUE_ROUTER:
            continue  # replaced below
        lines.append(line)
        if stripped == "[router]":
            lines += [f"{k} = {v}" for k, v in QUEUE_ROUTER.items()]
    if "[router]" not in (x.strip() for x in lines):
        lines += ["", "[router]", *(f"{k} = {v}" for k, v in QUEUE_ROUTER.items())]
    out.write_text("\n".join(lines) + "\n")
    return out


async def sweep_point(http: httpx.AsyncClient, base_url: str, workload: Workload, n: int, seed: int,
                      timing: SweepTiming, log) -> dict:
    """`n` sessions closed-loop (one that ends is replaced at once) for `timing.ramp_s +
    timing.window_s`; the calls sent in the window measured, their TTFT from their first attempt."""
    client = Client(http, base_url, time.perf_counter(), workload)
    stop = timing.ramp_s + timing.window_s
    pool = iter(plan_sessions(mix(20 * n + 100, random.Random(seed), workload.models), seed, f"sweep{n}",
                              workload=workload))

    async def slot() -> None:
        while client.now() < stop:
            await client.session(next(pool), delay=False)

    try:
        async with asyncio.timeout(stop + timing.tail_s):
            await asyncio.gather(*(slot() for _ in range(n)))
    except TimeoutError:
        pass  # sessions still running are cut off: their calls are cancelled, their clients disconnect
    wall = client.now()
    window = [c for r in client.sessions for c in r.calls if timing.ramp_s <= c.sent_s < stop]
    ok = [c for c in window if c.ok and c.done_s]
    # a call with no first token by the cut-off has waited at least until then: counted so
    ttft = [c.first_token_s - c.sent_s if c.first_token_s is not None else wall - c.sent_s
            for c in window if c.first_token_s is not None or not c.done_s]
    point = {"sessions": n, "calls": len(window), "calls_ok": len(ok), "cut_off": sum(not c.done_s for c in window),
             "failed": sum(bool(c.done_s) and not c.ok for c in window), "refused": sum(c.refused for c in window),
             "calls_per_min": len(ok) / timing.window_s * 60, "ttft_p50_s": pct(ttft, 50),
             "ttft_p95_s": pct(ttft, 95), "wall_s": wall}
    log(f"sweep: {n} sessions: {len(ok)} calls in {timing.window_s:.0f} s ({point['calls_per_min']:.1f}/min), "
        f"TTFT p50 {point['ttft_p50_s'] or 0:.2f} p95 {point['ttft_p95_s'] or 0:.2f} s, {point['failed']} failed, "
        f"{point['cut_off']} cut off, {point['refused']} refused")
    await asyncio.sleep(timing.pause_s)
    return point


async def sweep(base_url: str, workload: Workload, counts: list[int], seed: int, timing: SweepTiming,
                log) -> list[dict]:
    limits = httpx.Limits(max_connections=max(counts) + 32, max_keepalive_connections=max(counts) + 32)
    async with httpx.AsyncClient(timeout=httpx.Timeout(CALL_DEADLINE_S, connect=10.0), limits=limits) as http:
        warm = Client(http, base_url, time.perf_counter(), workload)
        await asyncio.gather(*(warm.session(p, delay=False) for p in plan_sessions(
            [m for m in workload.models for _ in range(WARMUP_SESSIONS)], -1 - seed, "warmup", WARMUP_TURNS,
            workload)))
        return [await sweep_point(http, base_url, workload, n, seed + i, timing, log) for i, n in enumerate(counts)]


def capacity_of(points: list[dict], ttft_target_s: float) -> dict:
    """The largest swept concurrency whose TTFT p95 met the target (no call failed), with its calls per
    minute: the goodput a run of the workload is judged against."""
    met = [p for p in points if p["ttft_p95_s"] is not None and p["ttft_p95_s"] <= ttft_target_s and not p["failed"]]
    best = max(met, key=lambda p: p["sessions"]) if met else None
    return {"ttft_target_s": ttft_target_s, "capacity_sessions": best["sessions"] if best else None,
            "capacity_calls_per_min": best["calls_per_min"] if best else None, "points": points}


def ttft_target(config: Path, models) -> float:
    """The TTFT target of the instances serving `models` (the smallest, if they differ)."""
    instances = tomllib.loads(config.read_text())["instances"]
    return min(i.get("ttft_s", 2.0) for i in instances if set(i["models"]) & set(models))


def run_sweep(args, workload: Workload, target_s: float, log: ProgressLog, load_start: float) -> int:
    timing = SWEEP_QUICK if args.quick else SWEEP
    out = args.json or RESULTS / f"load-sweep-{workload.name}{'-quick' if args.quick else ''}.json"
    server_log = out.with_name(out.stem + "-server.log")
    server_log.parent.mkdir(parents=True, exist_ok=True)
    config = queue_config(args.config, out.with_name(out.stem + "-config.toml"))
    log(f"sweep of {workload.name} at {args.sweep} sessions, {asdict(timing)}; {config} (overload = queue); "
        f"server log {server_log}")
    proc, base_url = start_server(config, server_log)
    try:
        wait_healthy(proc, base_url, server_log)
        points = asyncio.run(sweep(base_url, workload, args.sweep, args.seed, timing, log))
    finally:
        stop_server(proc)
    result = capacity_of(points, target_s) | {
        "workload": workload.name, "seed": args.seed, "quick": args.quick, "timing": asdict(timing),
        "config": str(config), "server_log_problems": server_log_problems(server_log), **environment(log, load_start)}
    rows = [("sessions", "calls/min", "TTFT p50 s", "TTFT p95 s", "calls", "cut off", "refused", "failed")]
    rows += [(str(p["sessions"]), f"{p['calls_per_min']:.1f}", f"{p['ttft_p50_s'] or 0:.2f}",
              f"{p['ttft_p95_s'] or 0:.2f}", str(p["calls"]), str(p["cut_off"]), str(p["refused"]), str(p["failed"]))
             for p in points]
    print(render(rows))
    cap = result["capacity_calls_per_min"]
    print(f"capacity at TTFT p95 <= {target_s:g} s: {result['capacity_sessions']} sessions, "
          f"{'-' if cap is None else f'{cap:.1f}'} calls/min")
    write_json(out, result, log)
    wrong = [f"{p['failed']} calls failed at {p['sessions']} sessions (errors: a wrong result)"
             for p in points if p["failed"]]
    missed = [] if cap is not None else [f"no swept concurrency met TTFT p95 <= {target_s:g} s"]
    return gate(missed, wrong, args.no_gate)


def run_load(args, workload: Workload, target_s: float, log: ProgressLog, load_start: float) -> int:
    n = 20 if args.quick else (args.sessions or workload.sessions)
    plans = plan_sessions(mix(n, random.Random(args.seed), workload.models), args.seed, workload=workload)
    models = list(workload.models)
    warmup = [dataclasses.replace(p, start_s=0.0) for p in plan_sessions(
        [m for m in models for _ in range(WARMUP_SESSIONS)], -1 - args.seed, "warmup", WARMUP_TURNS, workload)]
    too_long = [(p.id, p.model, n_tokens) for p in plans
                if (n_tokens := p.worst_prompt_tokens()) > workload.models[p.model].context]
    if too_long:
        raise SystemExit(f"{len(too_long)} sessions might outgrow their model's context, first {too_long[0]}")
    out = args.json or RESULTS / f"load-{workload.name}.json"
    capacity_path = args.capacity or RESULTS / f"load-sweep-{workload.name}.json"
    capacity = json.loads(capacity_path.read_text()) if capacity_path.exists() else None
    if capacity is not None and capacity.get("quick"):
        log(f"{capacity_path} is a --quick sweep, not a capacity: goodput not judged")
        capacity = None

    server_log = out.with_name(out.stem + "-server.log")
    server_log.parent.mkdir(parents=True, exist_ok=True)
    log(f"{workload.name}: {n} sessions ({', '.join(f'{m}: {sum(p.model == m for p in plans)}' for m in models)}), "
        f"{sum(len(p.turns) for p in plans)} calls; server log {server_log}")
    proc, base_url = start_server(args.config, server_log)
    try:
        wait_healthy(proc, base_url, server_log)
        log(f"serving on {base_url}; warm-up")
        run = asyncio.run(drive(base_url, warmup, plans, processes(proc, args.config), log, workload,
                                args.max_wall))
    finally:
        stop_server(proc)
    sessions = run["sessions"]
    summary = summarize(sessions, run["wall_s"])
    per_model = {m: summarize([s for s in sessions if s.model == m]) for m in models}
    growth = pss_growth(run["pss_warm"], run["pss_end"])
    missed, wrong = misses(summary, growth, workload, target_s, capacity)
    result = {
        "summary": {**summary, "run_wall_s": run["wall_s"]}, "per_model": per_model, "pss_growth": growth,
        "targets": TARGETS | {"ttft_s": target_s, "admit_within_s": workload.admit_within_s,
                              "max_429_per_admitted": workload.max_429_per_admitted},
        "capacity": capacity and {"path": str(capacity_path)} | {
            k: capacity.get(k) for k in ("capacity_sessions", "capacity_calls_per_min", "ttft_target_s", "date")},
        "passed": not missed and not wrong, "missed": missed, "wrong": wrong,
        "workload": {"name": workload.name, "sessions": n, "seed": args.seed, "config": str(args.config),
                     "arrival_s": workload.arrival_s, "models": {m: asdict(s) for m, s in workload.models.items()},
                     "max_tokens": MAX_TOKENS, "gap_s": workload.gap_s, "retries": workload.retries,
                     "retry_cap_s": workload.retry_cap_s, "call_deadline_s": CALL_DEADLINE_S,
                     "max_wall_s": args.max_wall,
                     "warmup": {"sessions_per_model": WARMUP_SESSIONS, "turns": WARMUP_TURNS}},
        "pss_warm": run["pss_warm"], "pss_end": run["pss_end"], "router": run["router"],
        "timeline": run["timeline"], "server_log": str(server_log),
        "server_log_problems": server_log_problems(server_log),
        "failed_calls": failed_calls(sessions),
        "sessions": [{"id": s.id, "model": s.model, "turns": s.turns, "outcome": s.outcome.value,
                      "start_s": s.start_s, "admitted_s": s.admitted_s, "end_s": s.end_s,
                      "calls": [{k: v for k, v in asdict(c).items() if k not in ("session", "model", "text")}
                                for c in s.calls]} for s in sessions],
        **environment(log, load_start),
    }
    print(table(summary, per_model, growth, workload, target_s, capacity))
    line = (run["router"] or {}).get("line") or {}
    print(f"admission line: {line.get('counts')}, scale {line.get('scale')}, "
          f"promise error {line.get('promise_error_s')}")
    write_json(out, result, log)
    return gate(missed, wrong, args.no_gate)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="burst", help="see the module docstring")
    ap.add_argument("--sessions", type=int, default=None, help="agent sessions (default: the workload's, 200)")
    ap.add_argument("--quick", action="store_true", help="20 sessions; with --sweep, short points (debugging)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the workload")
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="must serve " + ", ".join(MODELS))
    ap.add_argument("--json", type=Path, default=None, help="where to write results (default bench/results/...)")
    ap.add_argument("--sweep", type=lambda v: [int(x) for x in v.split(",")], default=None,
                    help="measure the capacity instead: these concurrencies, e.g. 2,4,8,12")
    ap.add_argument("--capacity", type=Path, default=None,
                    help="the sweep's JSON goodput is judged against (default bench/results/load-sweep-WORKLOAD.json)")
    ap.add_argument("--max-wall", type=float, default=None, metavar="S",
                    help="cut the sessions off S seconds after they start (a run that cannot finish in the time "
                    "there is: what it did is reported, and the cut is a missed target)")
    add_gate_flag(ap)
    args = ap.parse_args(argv)
    if args.sessions is not None and args.sessions < 1:
        ap.error("--sessions must be at least 1")
    if args.sweep is not None and min(args.sweep) < 1:
        ap.error("--sweep: every concurrency must be at least 1")
    workload = WORKLOADS[args.workload]
    target_s = ttft_target(args.config, workload.models)
    log, load_start = ProgressLog(), os.getloadavg()[0]
    if args.sweep:
        return run_sweep(args, workload, target_s, log, load_start)
    return run_load(args, workload, target_s, log, load_start)


if __name__ == "__main__":
    sys.exit(main())
