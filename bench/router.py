"""Routing overhead: the router's decision latency at fleet scale, and what the gateway adds to a call.

    python bench/router.py [--json PATH] [--decisions N] [--requests N] [--seed S] [--keep-gc]
                           [--only router|gateway] [--no-gate]

Two measurements in one run:

* **Decisions.** A `Router` (policy full, injected clock, no event sink) over 64 instances (16 hot
  serving one model, 48 cold serving 2-4 of 8 models) holds 100,000 sessions, each completed once,
  so its session and lease tables hold 100,000 live entries (lease_s is an hour of a clock that
  moves 50 us per decision). Every instance's snapshot lists its 256 most recent sessions, newest
  last, as the node's scheduler does, and snapshots are refreshed every 0.25 s of that clock. Each
  step routes one session listed in a snapshot (its lease is live: a lease hit), routes it again
  (its lease is now consumed: a cost-ranked decision for a returning session), completes it (a new
  lease, so 100,000 stay live) and routes a session never seen (a cost-ranked decision with no
  history). Two thirds of all decisions therefore have no lease. Each `route` call is timed alone
  with `perf_counter_ns`, with the garbage collector off (`--keep-gc` leaves it on), and bucketed
  by the reason the router gave. A linear scan of 256 snapshot session dicts is timed beside every
  step as a machine-speed reference: on a slower or busier machine it grows with the decisions.
* **Gateway.** `talaria up` with one hot TP=1 instance of the synthetic `tiny-llama`; one kept-alive
  socket speaking HTTP/1.1 with nothing in between (`RawClient`: the request written with one send,
  the response read to its headers, then Content-Length bytes) posts the same non-streaming 1-token
  completion (64-character prompt) and, beside each, a GET /health as the HTTP floor. What the
  client spends is not the gateway's time: httpx cost ~0.5 ms a call more than http.client here,
  and http.client (its header parsing) 0.2 ms more than this client on /health, 0.5 ms on a
  completion. Added latency = client-observed latency minus the
  instance's own time (`x-talaria-instance-time`: its arrival there to its final record).

Percentiles are nearest-rank. The targets: lease hit p99 <= 20 us, ranked p99 <= 250 us, gateway
added p50 <= 2.0 ms. The script exits 1 when one of those it measured is missed (`--no-gate`: exit
0, to explore), naming them after the table. Progress goes to stderr, the table to stdout,
everything to the JSON file (default bench/results/router.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import socket
import sys
import tempfile
import time
from collections import Counter, OrderedDict
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests/ (and talaria) from here

from report import (  # bench/report.py, beside this script
    ProgressLog,
    add_gate_flag,
    environment,
    gate,
    render,
    write_json,
)
from server import (  # bench/server.py
    START_TIMEOUT_S,
    start_server,
    stop_server,
    wait_healthy,
)

from talaria.config.schema import Pool, RouterConfig, RouterPolicy
from talaria.contracts.profile import (
    Bandwidth,
    DecodeCurve,
    ModelProfile,
    PrefillCurve,
    Profile,
    SwitchCost,
)
from talaria.contracts.telemetry import InstanceStats, ModelQueue, RoundState
from talaria.contracts.vocabulary import SwitchPath
from talaria.replay import percentile
from talaria.routing.decision import Reason, RouteRequest
from talaria.routing.instance_view import InstanceView
from talaria.routing.router import Router
from tests.served_models import synthetic_model_toml

TARGETS = {"lease_hit_p99_us": 20.0, "ranked_p99_us": 250.0, "gateway_added_p50_ms": 2.0}  # all upper bounds

MODELS = tuple(f"m{i}" for i in range(8))
HOT, COLD = 16, 48  # instances
SESSIONS = 100_000
SHOWN = 256  # sessions a snapshot lists (talaria.instance.scheduler.MAX_SESSIONS_SHOWN)
TICK_S = 50e-6  # router clock per decision (or per completion while filling the tables)
REFRESH_S = 0.25  # telemetry period
WARMUP_STEPS = 2_000
# 100,000 live leases put ~1,600 on each instance; at the default lease_unit of 1 each charges a whole
# call of queue, every instance predicts minutes of wait and every call is rejected. A thousandth
# keeps the candidates admissible, so the decisions measured are real rankings; the work is the same.
CONFIG = RouterConfig(policy=RouterPolicy.FULL, lease_s=3600.0, lease_unit=0.001)
# An H200-like cost profile for 8B-class models (the numbers only steer which branch a decision takes)
PROFILE = Profile(
    "synthetic: H200-like", "cuda", 1, 141 << 30, "2026-11-30T00:00:00+00:00", "hand-written for bench/router.py",
    Bandwidth(50e9, 50e9, 3e12),
    {m: ModelProfile(m, 16 << 30, 128 << 10, PrefillCurve(0.005, 50e-6, 1e-9), DecodeCurve(0.02, 1e-4, 1e-8),
                     {SwitchPath.H2D_ONLY: SwitchCost(SwitchPath.H2D_ONLY, (0.05, 0.35, 0.01, 0.02, 0.001)),
                      SwitchPath.FULL_D2D: SwitchCost(SwitchPath.FULL_D2D, (0.05, 0.01, 0.01, 0.02, 0.001))})
     for m in MODELS})
ROUND_S = 1.6  # gamma * ttft_s at the defaults

GATEWAY_MODEL = "tiny-llama"
PROMPT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs!"[:64]
WARMUP_REQUESTS = 20



# ---- the router at scale -----------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Fleet:
    """A Router over 64 instances whose telemetry this object invents: snapshots with queues, rounds
    and the recent-session lists a node reports, refreshed every REFRESH_S of the injected clock."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.clock = rng, Clock()
        self.router = Router(CONFIG, self.clock)
        self.models: dict[str, tuple[str, ...]] = {}
        for i in range(HOT):
            self.models[f"hot-{i}"] = (MODELS[i % len(MODELS)],)
        for i in range(COLD):
            self.models[f"cold-{i}"] = tuple(rng.sample(MODELS, rng.choice((2, 3, 4))))
        self.recent = {name: OrderedDict() for name in self.models}  # session -> entry, newest last
        self.versions = Counter()
        self.listed: list[str] = []  # sessions some snapshot lists now: the ones that return
        self.serving = {m: [n for n, ms in self.models.items() if m in ms] for m in MODELS}
        for name, models in self.models.items():
            self.router.views[name] = InstanceView(name, models, healthy=True, profile=PROFILE)
        self.refresh()

    def snapshot(self, name: str) -> InstanceStats:
        rng, models, hot = self.rng, self.models[name], name.startswith("hot")
        active = models[0] if hot else rng.choice(models)
        staged = None if hot or len(models) == 1 else rng.choice([m for m in models if m != active])
        queues = tuple(ModelQueue(m, rng.randrange(4), rng.randrange(16), m == active) for m in models)
        rounds = None if hot else RoundState(self.versions[name], rng.uniform(0.0, ROUND_S), None, {}, 0, 0, (),
                                             round_s=ROUND_S)
        self.versions[name] += 1
        return InstanceStats(name, sum(q.waiting for q in queues), sum(q.running for q in queues),
                             rng.randrange(4096), 8192, models=models, active_model=active,
                             substrate={"staging_coverage": rng.random()}, sessions=tuple(self.recent[name].values()),
                             version=self.versions[name], pool=Pool.HOT if hot else Pool.COLD, staged_model=staged,
                             queues=queues, rounds=rounds, page_size=16)

    def refresh(self) -> None:
        for name in self.models:
            self.router.observe(name, self.snapshot(name))
        self.listed = [s for entries in self.recent.values() for s in entries]
        self.next_refresh = self.clock.now + REFRESH_S

    def tick(self) -> None:
        self.clock.now += TICK_S
        if self.clock.now >= self.next_refresh:
            self.refresh()

    def complete(self, req: RouteRequest, instance: str) -> None:
        """The call ran and finished: the router's lease and session entry, and the node's list."""
        kv = req.prompt_tokens + req.max_tokens
        self.router.complete(req, instance, kv)
        recent = self.recent[instance]
        recent[req.session] = {"session": req.session, "model": req.model, "kv_tokens": kv,
                               "location": "device" if self.rng.random() < 0.8 else "host",
                               "device_tokens": kv, "host_tokens": kv}
        recent.move_to_end(req.session)
        while len(recent) > SHOWN:
            recent.popitem(last=False)

    def fill(self, log: ProgressLog) -> dict[str, tuple[str, int]]:
        """SESSIONS sessions, each completed once on a random instance serving its model."""
        sessions = {}
        for i in range(SESSIONS):
            model = self.rng.choice(MODELS)
            req = RouteRequest(model, f"s{i}", self.rng.randint(500, 8000), self.rng.randint(64, 512))
            self.complete(req, self.rng.choice(self.serving[model]))
            sessions[req.session] = (model, req.prompt_tokens + req.max_tokens)
            self.tick()
        log(f"router: {len(self.router.sessions)} sessions, {len(self.router.leases)} live leases")
        return sessions


def reference_scan(entries: tuple[dict, ...], session: str) -> None:
    """What `Router._location` does per snapshot: a linear scan of the listed sessions."""
    for entry in entries:
        if entry.get("session") == session and entry.get("model") == "":
            return


def measure_router(steps: int, rng: random.Random, keep_gc: bool, log: ProgressLog) -> dict:
    """Fill the tables, warm up, then time `steps` x (lease hit, returning without lease, new)."""
    fleet = Fleet(rng)
    sessions = fleet.fill(log)
    router, timer = fleet.router, time.perf_counter_ns
    decisions: list[tuple[str, str, int]] = []  # (what the step meant it to be, the router's reason, ns)
    reference: list[int] = []
    scanned = fleet.router.views["cold-0"].snapshot.sessions  # a full list of SHOWN entries

    def route(req: RouteRequest, kind: str, keep: bool):
        t0 = timer()
        decision = router.route(req)
        t1 = timer()
        fleet.tick()
        if keep:
            decisions.append((kind, decision.reason.value, t1 - t0))
        return decision

    log(f"router: {WARMUP_STEPS} warm-up steps, then {steps} steps of 3 decisions "
        f"(gc {'on' if keep_gc else 'off'} while timing)")
    gc.collect()
    if not keep_gc:
        gc.disable()
    try:
        for step in range(WARMUP_STEPS + steps):
            keep = step >= WARMUP_STEPS
            session = rng.choice(fleet.listed)
            model, kv = sessions[session]
            req = RouteRequest(model, session, kv + rng.randint(100, 1000), rng.randint(64, 512), f"r{step}")
            first = route(req, "lease", keep)  # its lease is live
            again = route(req, "returning", keep)  # the first route consumed it
            instance = again.instance or first.instance  # rejected: it ran where its lease was
            if instance is not None:  # both rejected (rare): the session has no lease until it runs
                router.sent(instance)
                router.finished(instance)
                fleet.complete(req, instance)  # a new lease: 100,000 stay live
                sessions[session] = (model, req.prompt_tokens + req.max_tokens)
            route(RouteRequest(rng.choice(MODELS), f"new{step}", rng.randint(500, 8000), rng.randint(64, 512),
                               f"n{step}"), "new", keep)  # never completed: the tables keep their size
            t0 = timer()
            reference_scan(scanned, "absent")
            if keep:
                reference.append(timer() - t0)
            if step and step % 5000 == 0:
                log(f"router: step {step}")
    finally:
        gc.enable()
    return summarize_router(decisions, reference, router, keep_gc)


def us(ns: list[int], q: float) -> float:
    return percentile(ns, q) / 1e3


def summarize_router(decisions: list[tuple[str, str, int]], reference: list[int], router: Router,
                     keep_gc: bool) -> dict:
    hits = [ns for _, reason, ns in decisions if reason == Reason.LEASE_HIT.value]
    ranked = [ns for _, reason, ns in decisions if reason != Reason.LEASE_HIT.value]
    out = {"lease_hit_p50_us": us(hits, 50), "lease_hit_p99_us": us(hits, 99), "lease_hit_count": len(hits),
           "ranked_p50_us": us(ranked, 50), "ranked_p99_us": us(ranked, 99), "ranked_count": len(ranked)}
    for kind in ("returning", "new"):
        ns = [ns for k, reason, ns in decisions if k == kind and reason != Reason.LEASE_HIT.value]
        out.update({f"ranked_{kind}_p50_us": us(ns, 50), f"ranked_{kind}_p99_us": us(ns, 99),
                    f"ranked_{kind}_count": len(ns)})
    out.update(reasons=dict(Counter(f"{k}:{reason}" for k, reason, _ in decisions)),
               reference_scan_p50_us=us(reference, 50), reference_scan_p99_us=us(reference, 99),
               lease_misses=router.stats.lease_misses, sessions=len(router.sessions),
               live_leases=len(router.leases), gc_disabled_while_timing=not keep_gc)
    return out


# ---- the gateway, with the server started as tests/conftest.py starts it -----------------------

CONFIG_TEXT = f"""[server]
host = "127.0.0.1"

{synthetic_model_toml(GATEWAY_MODEL, "llama", 1, tie_word_embeddings=False)}
[[instances]]
name = "hot-0"
pool = "hot"
models = ["{GATEWAY_MODEL}"]
tp = 1
arena_bytes = "64MiB"
"""


def measure_gateway(requests: int, log: ProgressLog) -> dict:
    """Client latency of a 1-token completion, the instance's own time, and GET /health beside it."""
    body = json.dumps({"model": GATEWAY_MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}).encode()
    client_ms, instance_ms, added_ms, health_ms = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="talaria-bench-router-") as tmp:
        config, log_path = Path(tmp) / "talaria.toml", Path(tmp) / "talaria.log"
        config.write_text(CONFIG_TEXT)
        proc, base_url = start_server(config, log_path)
        try:
            wait_healthy(proc, base_url, log_path)
            log(f"gateway: serving on {base_url}; {WARMUP_REQUESTS} warm-up then {requests} completions")
            url = urlsplit(base_url)
            client = RawClient(url.hostname, url.port)
            try:
                early_429 = wait_routable(client, body)
                for i in range(WARMUP_REQUESTS + requests):
                    t0 = time.perf_counter()
                    _, headers = request(client, "POST", "/v1/completions", body)
                    t1 = time.perf_counter()
                    request(client, "GET", "/health")
                    t2 = time.perf_counter()
                    if i < WARMUP_REQUESTS:
                        continue
                    instance_s = float(headers["x-talaria-instance-time"])
                    client_ms.append((t1 - t0) * 1e3)
                    instance_ms.append(instance_s * 1e3)
                    added_ms.append((t1 - t0 - instance_s) * 1e3)
                    health_ms.append((t2 - t1) * 1e3)
            finally:
                client.close()
        finally:
            stop_server(proc)
    return {"gateway_added_p50_ms": percentile(added_ms, 50), "gateway_added_p95_ms": percentile(added_ms, 95),
            "client_p50_ms": percentile(client_ms, 50), "client_p95_ms": percentile(client_ms, 95),
            "instance_time_p50_ms": percentile(instance_ms, 50), "instance_time_p95_ms": percentile(instance_ms, 95),
            "health_p50_ms": percentile(health_ms, 50), "health_p95_ms": percentile(health_ms, 95),
            "requests": len(client_ms), "prompt_chars": len(PROMPT), "body_bytes": len(body),
            "early_429s": early_429, "samples_ms": {"client": client_ms, "instance": instance_ms, "health": health_ms}}


class RawClient:
    """HTTP/1.1 over one kept-alive TCP socket, and nothing else: enough for JSON responses, which
    the gateway always sends with a Content-Length."""

    def __init__(self, host: str, port: int, timeout_s: float = 60.0) -> None:
        self._sock = socket.create_connection((host, port), timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._host = f"{host}:{port}"
        self._buf = b""

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
        """(status, headers with lower-case names, body) of one request."""
        head = f"{method} {path} HTTP/1.1\r\nhost: {self._host}\r\n"
        if body is not None:
            head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        self._sock.sendall(head.encode() + b"\r\n" + (body or b""))
        while (end := self._buf.find(b"\r\n\r\n")) < 0:
            self._fill()
        status_line, *lines = self._buf[:end].decode("latin-1").split("\r\n")
        self._buf = self._buf[end + 4:]
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers["content-length"])
        while len(self._buf) < length:
            self._fill()
        data, self._buf = self._buf[:length], self._buf[length:]
        return int(status_line.split(" ", 2)[1]), headers, data

    def _fill(self) -> None:
        chunk = self._sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self._buf += chunk

    def close(self) -> None:
        self._sock.close()


def request(client: RawClient, method: str, path: str, body: bytes | None = None,
            ok: tuple[int, ...] = (200,)) -> tuple[int, dict[str, str]]:
    """One call on the kept-alive connection, its body read; raise unless the status is in `ok`."""
    status, headers, data = client.request(method, path, body)
    if status not in ok:
        raise RuntimeError(f"{method} {path}: HTTP {status}: {data[:500]!r}")
    return status, headers


def wait_routable(client: RawClient, body: bytes) -> int:
    """Post until the first 200; the 429s before it, answered while /health is already 200 but the
    router has no snapshot of the instance yet."""
    deadline, rejected = time.monotonic() + START_TIMEOUT_S, 0
    while True:
        status, _ = request(client, "POST", "/v1/completions", body, ok=(200, 429))
        if status == 200:
            return rejected
        if time.monotonic() > deadline:
            raise RuntimeError(f"still 429 after {START_TIMEOUT_S} s")
        rejected += 1
        time.sleep(0.05)


# ---- report ------------------------------------------------------------------------------------

def met(m: dict) -> dict[str, bool]:
    return {key: m[key] <= bound for key, bound in TARGETS.items() if key in m}


def table(m: dict) -> str:
    ok = met(m)
    rows = [("metric", "value", "target", "met")]

    def row(label: str, key: str, fmt: str = "{:.1f}") -> None:
        if key not in m:  # --only the other measurement
            return
        target = f"<= {TARGETS[key]:g}" if key in TARGETS else "-"
        rows.append((label, fmt.format(m[key]), target, ("yes" if ok[key] else "NO") if key in ok else "-"))

    row(f"lease hit p50 us ({m.get('lease_hit_count')} decisions)", "lease_hit_p50_us")
    row("lease hit p99 us", "lease_hit_p99_us")
    row(f"ranked p50 us ({m.get('ranked_count')} decisions)", "ranked_p50_us")
    row("ranked p99 us", "ranked_p99_us")
    row("  returning session, lease consumed: p99 us", "ranked_returning_p99_us")
    row("  new session: p99 us", "ranked_new_p99_us")
    row("reference: scan of 256 session dicts, p50 us", "reference_scan_p50_us", "{:.2f}")
    row("gateway added p50 ms", "gateway_added_p50_ms", "{:.2f}")
    row("gateway added p95 ms", "gateway_added_p95_ms", "{:.2f}")
    row("client latency p50 ms", "client_p50_ms", "{:.2f}")
    row("client latency p95 ms", "client_p95_ms", "{:.2f}")
    row("instance time p50 ms", "instance_time_p50_ms", "{:.2f}")
    row("GET /health p50 ms (HTTP floor)", "health_p50_ms", "{:.2f}")
    return render(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=Path("bench/results/router.json"), help="where to write results")
    ap.add_argument("--decisions", type=int, default=20_000, help="timed steps (each: lease hit + 2 ranked)")
    ap.add_argument("--requests", type=int, default=300, help="timed completions through the gateway")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic fleet and sessions")
    ap.add_argument("--keep-gc", action="store_true", help="leave the garbage collector on while timing")
    ap.add_argument("--only", choices=("router", "gateway"), help="run one of the two measurements")
    add_gate_flag(ap)
    args = ap.parse_args(argv)
    if args.decisions < 100 or args.requests < 20:
        ap.error("--decisions must be at least 100 and --requests at least 20: the report is a p99 and a p95")

    log = ProgressLog()
    load_start = os.getloadavg()[0]
    log(f"router: {HOT} hot + {COLD} cold instances, {len(MODELS)} models, {SESSIONS} sessions; "
        f"load average {load_start:.2f}")
    m = {}
    if args.only != "gateway":
        m.update(measure_router(args.decisions, random.Random(args.seed), args.keep_gc, log))
        gc.collect()  # drop the router's tables before the gateway run
    if args.only != "router":
        m.update(measure_gateway(args.requests, log))
    ok = met(m)
    result = {**m, "targets": TARGETS, "met": ok,
              "config": {"instances": {"hot": HOT, "cold": COLD}, "models": len(MODELS), "sessions": SESSIONS,
                         "shown_per_snapshot": SHOWN, "tick_s": TICK_S, "refresh_s": REFRESH_S,
                         "lease_s": CONFIG.lease_s, "lease_unit": CONFIG.lease_unit, "steps": args.decisions,
                         "warmup_steps": WARMUP_STEPS, "requests": args.requests, "seed": args.seed},
              **environment(log, load_start)}
    print(table(m))
    print(f"(router: nearest-rank percentiles of single route() calls, gc {'on' if args.keep_gc else 'off'}; "
          "ranked = every decision that was not a lease hit; gateway: client latency minus "
          f"x-talaria-instance-time; load average {load_start:.2f} -> {result['load_average']['end']:.2f} "
          f"on {result['cpu_count']} CPUs)")
    write_json(args.json, result, log)
    return gate([f"{k} = {m[k]:.2f} > {TARGETS[k]:g}" for k, good in ok.items() if not good], [], args.no_gate)


if __name__ == "__main__":
    sys.exit(main())
