"""Load: N concurrent agent sessions against `talaria up`, with clients that honour Retry-After.

    python bench/load.py [--sessions N] [--quick] [--seed S] [--config PATH] [--json PATH]

The workload, fixed before any measurement (seeded; the same --seed gives the same sessions, bodies,
gaps and, through each call's `seed`, the same sampled tokens):

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
* The client: a 429 is retried after its Retry-After (default 2 s), at most 5 times. A session whose
  FIRST call is still refused after that is *shed* (a new session turned away: allowed). A session
  whose first call was answered 200 is *admitted*; any later failure of one of its calls (429 after
  the retries, any other status, an in-band stream error, a stream without `[DONE]`, an attempt not
  over within 180 s: queueing and streaming included) is a *failed call of an admitted session*,
  and the session stops there.

Measured: failed calls of admitted sessions; 429s to new sessions (first calls) and to admitted
ones (retried); shed sessions; sessions in service at once (the most sessions between their first
call's 200 and their last call's end, exact from the records; a 1 s timeline also goes to the JSON);
TTFT p50/p95 from sending the answered attempt to the first delta with content (the role-only chunk
skipped; reasoning or tool-call deltas count); SCT p50/p95 (first attempt of the first call to the
end of the last call, retries and gaps included) of finished sessions; the PSS (psutil
`memory_full_info().pss`) of the supervisor and of each worker after warm-up and at the end.
Targets at 200 sessions on the default config: zero failed calls of admitted sessions, zero calls
failed with anything but a shedding 429, at least 32 sessions (all, when fewer) in service at
once, every admitted session finishes, PSS growth below 20% for the supervisor and for each worker
(each alone: a leak in the 80 MB supervisor would vanish in the 3 GB total). Progress goes to
stderr, the table to stdout, everything to the JSON (default bench/results/load.json) and the server
log beside it. Exits 1 and names the missed targets when one is missed.
"""

from __future__ import annotations

import argparse
import asyncio
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
    environment,
    render,
    write_json,
)
from server import start_server, stop_server, wait_healthy  # bench/server.py

from talaria.replay import percentile

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "talaria" / "talaria.toml"


@dataclass(frozen=True, slots=True)
class ModelShape:
    share: int  # sessions of every 10
    context: int  # tokens
    turns: tuple[int, int]  # K, uniform
    tool_chars: tuple[int, int]  # a tool result's length, uniform


MODELS = {"smollm2": ModelShape(2, 8192, (4, 8), (200, 600)),
          "tiny-llama": ModelShape(4, 2048, (4, 6), (60, 150)),
          "tiny-qwen3": ModelShape(4, 2048, (4, 6), (60, 150))}
SYSTEM = ("You are a coding agent working in a git checkout. Use the tools to read and edit files, run "
          "the tests after every change, and answer briefly.")  # 160 bytes with the model's name
MAX_TOKENS = (16, 32)
GAP_S = (0.5, 3.0)
RETRIES = 5  # on a 429, after its Retry-After
CALL_DEADLINE_S = 180.0  # an attempt not over this long (held at the gateway or streaming) fails
TEMPLATE_TOKENS = 40  # per message, an upper bound on what a chat template adds
WARMUP_SESSIONS, WARMUP_TURNS = 4, 2  # per model
TARGETS = {"max_in_service": 32, "pss_growth": 0.20}


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


def mix(n: int, rng: random.Random) -> list[str]:
    """`n` sessions' models in the shares of MODELS (by rounds of 10), shuffled."""
    deck = [m for m, shape in MODELS.items() for _ in range(shape.share)]
    models = [deck[i % len(deck)] for i in range(n)]
    rng.shuffle(models)
    return models


def plan_sessions(models: list[str], seed: int, prefix: str = "s", max_turns: int | None = None) -> list[SessionPlan]:
    rng = random.Random(seed)
    plans = []
    for i, model in enumerate(models):
        shape = MODELS[model]
        k = min(rng.randint(*shape.turns), max_turns or shape.turns[1])
        turns = tuple(Turn("" if j == 0 else tool_result(rng, rng.randint(*shape.tool_chars)),
                           0.0 if j == 0 else round(rng.uniform(*GAP_S), 3),
                           rng.randint(*MAX_TOKENS), rng.randrange(2**31)) for j in range(k))
        task = f"Task {i}: the test tests/test_mod_{rng.randrange(99)}.py fails; find the cause and fix it."
        plans.append(SessionPlan(f"{prefix}-{seed}-{i}-{model}", model, task, turns))
    return plans


# ---- one session, as an agent client runs it ----------------------------------------------------

class Outcome(Enum):
    FINISHED = "finished"  # every call succeeded
    SHED = "shed"  # its first call was refused with 429 RETRIES + 1 times
    REFUSED = "refused"  # its first call failed with anything else: a server error, not shedding
    FAILED = "failed"  # admitted, then a call failed


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
    status: int | None = None  # of the last attempt
    answered_s: float | None = None  # the 200's headers arrived: the router placed the call
    ttft_s: float | None = None  # the answered attempt sent -> its first content delta
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

    def __init__(self, http: httpx.AsyncClient, base_url: str, t0: float) -> None:
        self.http, self.url, self.t0 = http, base_url + "/v1/chat/completions", t0
        self.sessions: list[SessionRecord] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def session(self, plan: SessionPlan) -> SessionRecord:
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
                rec.outcome = Outcome.SHED if call.status == 429 else Outcome.REFUSED
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
            if c.status == 429 and c.error is None:
                c.n429 += 1
                if c.n429 <= RETRIES:
                    await asyncio.sleep(retry_after)
                    continue
                c.error = f"429 after {RETRIES} retries"
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
                        c.ttft_s = c.last_delta_s - sent if c.ttft_s is None else c.ttft_s
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


async def drive(base_url: str, warmup: list[SessionPlan], plans: list[SessionPlan], procs, log) -> dict:
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=len(plans) + 32, max_keepalive_connections=len(plans) + 32)
    timeout = httpx.Timeout(CALL_DEADLINE_S, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http, \
            httpx.AsyncClient(timeout=5.0) as probe:
        warm = Client(http, base_url, t0)
        await asyncio.gather(*(warm.session(p) for p in warmup))
        bad = [c.error for s in warm.sessions for c in s.calls if not c.ok]
        log(f"warm-up: {len(warmup)} sessions, {sum(len(s.calls) for s in warm.sessions)} calls, "
            f"{len(bad)} failed{': ' + bad[0] if bad else ''}")
        pss_warm = pss(procs)
        client, timeline = Client(http, base_url, time.perf_counter()), []

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
                    row["instances"] = instance_rows((await probe.get(base_url + "/talaria/telemetry")).json())
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                    row["telemetry_error"] = f"{type(exc).__name__}: {exc}"
                timeline.append(row)
                if len(timeline) % 10 == 0:
                    insts = "; ".join(f"{n}: {i['running']} running, {i['waiting']} waiting, KV {i['kv_pages_used']}/"
                                      f"{i['kv_pages_total']}, {i['preemptions']} preempted"
                                      for n, i in row.get("instances", {}).items())
                    log(f"t={row['t_s']:.0f}s in service {row['in_service']}, waiting first call "
                        f"{row['waiting_first_call']}, done {row['done']}/{len(plans)}; {insts}")

        sampler = asyncio.create_task(sample())
        await asyncio.gather(*(client.session(p) for p in plans))
        wall = client.now()
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


def summarize(sessions: list[SessionRecord]) -> dict:
    calls = [c for s in sessions for c in s.calls]
    admitted = [s for s in sessions if s.admitted_s is not None]
    ok = [c for s in admitted for c in s.calls if c.ok]
    ttft = [c.ttft_s for c in ok if c.ttft_s is not None]
    sct = [s.end_s - s.start_s for s in sessions if s.outcome is Outcome.FINISHED]
    prompt = sum(c.prompt_tokens or 0 for c in ok)
    return {
        "sessions": len(sessions), "admitted": len(admitted),
        "finished": sum(s.outcome is Outcome.FINISHED for s in sessions),
        "shed": sum(s.outcome is Outcome.SHED for s in sessions),
        "refused_with_error": sum(s.outcome is Outcome.REFUSED for s in sessions),
        "admitted_unfinished": sum(s.outcome is not Outcome.FINISHED for s in admitted),
        "failed_calls_admitted": sum(not c.ok for s in admitted for c in s.calls),
        "failed_calls_not_429": sum(not c.ok and c.status != 429 for c in calls),
        "new_session_429s": sum(s.calls[0].n429 for s in sessions),
        "admitted_session_429s": sum(c.n429 for s in admitted for c in s.calls[1:]),
        "max_in_service": max_overlap([(s.admitted_s, s.end_s) for s in admitted if s.end_s is not None]),
        "calls": len(calls), "calls_ok": len(ok), "calls_without_content": sum(c.ttft_s is None for c in ok),
        "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95),
        "sct_p50_s": pct(sct, 50), "sct_p95_s": pct(sct, 95),
        "prompt_tokens": prompt, "cached_fraction": sum(c.cached_tokens or 0 for c in ok) / prompt if prompt else None,
        "first_call_wait_p95_s": pct([s.admitted_s - s.start_s for s in admitted], 95),
    }


def pss_growth(warm: dict, end: dict) -> dict:
    out = {}
    for name, w in warm.items():
        e = end.get(name, {})
        ratio = (e["pss_bytes"] / w["pss_bytes"] - 1) if w.get("pss_bytes") and e.get("pss_bytes") else None
        out[name] = {"warm_mib": (w.get("pss_bytes") or 0) / 2**20, "end_mib": (e.get("pss_bytes") or 0) / 2**20,
                     "growth": ratio}
    return out


def misses(s: dict, growth: dict, in_service: int) -> list[str]:
    """The targets missed; `in_service`: the sessions in service at once required (fewer with fewer sessions)."""
    out = []
    if s["failed_calls_admitted"]:
        out.append(f"{s['failed_calls_admitted']} failed calls of admitted sessions (target 0; errors in the JSON)")
    if s["failed_calls_not_429"]:
        out.append(f"{s['failed_calls_not_429']} calls failed with something other than a 429 (target 0)")
    if s["max_in_service"] < in_service:
        out.append(f"{s['max_in_service']} sessions in service at once (target >= {in_service})")
    if s["admitted_unfinished"]:
        out.append(f"{s['admitted_unfinished']} admitted sessions did not finish (target 0)")
    for name, g in growth.items():
        if g["growth"] is None or g["growth"] >= TARGETS["pss_growth"]:
            out.append(f"PSS of {name}: {g['warm_mib']:.0f} -> {g['end_mib']:.0f} MiB "
                       f"(target growth < {TARGETS['pss_growth']:.0%}; None: the process is gone)")
    return out


def table(s: dict, per_model: dict, growth: dict, in_service: int) -> str:
    def f(v, scale=1.0, digits=2):
        return "-" if v is None else f"{v * scale:.{digits}f}"

    rows = [("metric", "value", "target")]
    for key, target in (("sessions", ""), ("admitted", ""), ("finished", ""), ("shed", ""),
                        ("admitted_unfinished", "0"), ("failed_calls_admitted", "0"), ("failed_calls_not_429", "0"),
                        ("new_session_429s", ""), ("admitted_session_429s", ""), ("max_in_service", f">= {in_service}"),
                        ("calls", ""), ("calls_without_content", "")):
        rows.append((key, str(s[key]), target))
    for key in ("ttft_p50_s", "ttft_p95_s", "sct_p50_s", "sct_p95_s", "first_call_wait_p95_s"):
        rows.append((key, f(s[key]), ""))
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
    for c in (c for s in sessions for c in s.calls if not c.ok and (s.admitted_s is not None or c.status != 429)):
        meanwhile = [o for o in calls if o.model == c.model and o.session != c.session and o.answered_s is not None
                     and c.sent_s < o.answered_s < c.done_s]
        out.append(asdict(c) | {"text": c.text[:80], "placed_meanwhile": len(meanwhile),
                                "placed_meanwhile_within_1s": sum(o.answered_s - o.sent_s < 1.0 for o in meanwhile)})
    return out


def server_log_problems(path: Path, limit: int = 60) -> list[str]:
    keys = ("error", "traceback", "exception", "warning", "restart", "stall", "killed")
    lines = [x for x in path.read_text(errors="replace").splitlines() if any(k in x.lower() for k in keys)]
    return lines[:limit]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=200, help="concurrent agent sessions")
    ap.add_argument("--quick", action="store_true", help="20 sessions (debugging)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the workload")
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="must serve " + ", ".join(MODELS))
    ap.add_argument("--json", type=Path, default=Path("bench/results/load.json"), help="where to write results")
    args = ap.parse_args(argv)
    n = 20 if args.quick else args.sessions
    if n < 1:
        ap.error("--sessions must be at least 1")
    plans = plan_sessions(mix(n, random.Random(args.seed)), args.seed)
    warmup = plan_sessions([m for m in MODELS for _ in range(WARMUP_SESSIONS)], -1 - args.seed, "warmup", WARMUP_TURNS)
    too_long = [(p.id, p.model, n_tokens) for p in plans
                if (n_tokens := p.worst_prompt_tokens()) > MODELS[p.model].context]
    if too_long:
        ap.error(f"{len(too_long)} sessions might outgrow their model's context, first {too_long[0]}")

    log = ProgressLog()
    load_start = os.getloadavg()[0]
    server_log = args.json.with_name(args.json.stem + "-server.log")
    server_log.parent.mkdir(parents=True, exist_ok=True)
    log(f"{n} sessions ({', '.join(f'{m}: {sum(p.model == m for p in plans)}' for m in MODELS)}), "
        f"{sum(len(p.turns) for p in plans)} calls; server log {server_log}")
    proc, base_url = start_server(args.config, server_log)
    try:
        wait_healthy(proc, base_url, server_log)
        log(f"serving on {base_url}; warm-up")
        run = asyncio.run(drive(base_url, warmup, plans, processes(proc, args.config), log))
    finally:
        stop_server(proc)
    sessions = run["sessions"]
    summary = summarize(sessions)
    per_model = {m: summarize([s for s in sessions if s.model == m]) for m in MODELS}
    growth = pss_growth(run["pss_warm"], run["pss_end"])
    in_service = min(TARGETS["max_in_service"], n)
    missed = misses(summary, growth, in_service)
    result = {
        "summary": {**summary, "run_wall_s": run["wall_s"]}, "per_model": per_model, "pss_growth": growth,
        "targets": TARGETS, "passed": not missed, "missed": missed,
        "workload": {"sessions": n, "seed": args.seed, "config": str(args.config), "arrival": "all at once",
                     "models": {m: asdict(s) for m, s in MODELS.items()}, "max_tokens": MAX_TOKENS, "gap_s": GAP_S,
                     "retries": RETRIES, "call_deadline_s": CALL_DEADLINE_S,
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
    print(table(summary, per_model, growth, in_service))
    write_json(args.json, result, log)
    for m in missed:
        print(f"bench/load.py: FAIL: {m}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
