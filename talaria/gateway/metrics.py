"""Prometheus metrics of one gateway, on its own `CollectorRegistry`.

Latency histograms and token counters are plain numbers the gateway updates as calls finish, turned
into metric families at scrape time like everything else here; per-instance load
(queue depth, running sequences, KV pages) is read from `supervisor.stats()` at scrape time, so it is
never stale and costs nothing between scrapes; switches by path are counted from the node's event
log as they happen, and the peer set is read at scrape time. A registry per app (not prometheus-client's global
one) lets several gateways — or a simulator and a live node — share a process.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from itertools import accumulate

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from talaria.config.schema import Pool
from talaria.contracts.call import Usage
from talaria.contracts.events import Event, EventKind
from talaria.contracts.telemetry import InstanceStats
from talaria.contracts.vocabulary import SwitchPath
from talaria.node.event_log import EventLog
from talaria.routing.peer_set import PeerSet
from talaria.routing.router import Router

log = logging.getLogger(__name__)

# Agent prompts run to 100K tokens and cold instances rotate models, so TTFT spans ms to minutes.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0)


class InstanceStatsCollector:
    """Scrape-time gauges from the supervisor's latest per-instance stats."""

    def __init__(self, stats: Callable[[], Iterable[InstanceStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            stats = list(self._stats())
        except Exception:  # a scrape must not fail because one source did
            log.exception("supervisor.stats() failed during a /metrics scrape")
            return
        waiting = GaugeMetricFamily("talaria_num_requests_waiting", "Calls queued at the instance", labels=["instance"])
        running = GaugeMetricFamily("talaria_num_requests_running", "Sequences decoding", labels=["instance"])
        used = GaugeMetricFamily("talaria_kv_pages_used", "KV cache pages in use", labels=["instance"])
        total = GaugeMetricFamily("talaria_kv_pages_total", "KV cache pages in the pool", labels=["instance"])
        usage = GaugeMetricFamily("talaria_kv_usage_ratio", "KV pages used / total (0..1)", labels=["instance"])
        preempt = CounterMetricFamily("talaria_preemptions", "Sequences preempted", labels=["instance"])
        lost = CounterMetricFamily("talaria_lost_kv_tokens", "KV tokens computed, lost on preemption and "
                                   "recomputed", labels=["instance"])
        switches = CounterMetricFamily("talaria_model_switches", "Model switches", labels=["instance"])
        sp = CounterMetricFamily("talaria_sp_returns", "Continuations returning mid-slot, by outcome",
                                 labels=["instance", "outcome"])
        risk = CounterMetricFamily("talaria_deadline_risk", "Round-budget shortfalls reported by the round "
                                   "scheduler", labels=["instance", "reason"])
        for s in stats:
            label = [s.instance]
            waiting.add_metric(label, s.waiting)
            running.add_metric(label, s.running)
            used.add_metric(label, s.kv_pages_used)
            total.add_metric(label, s.kv_pages_total)
            usage.add_metric(label, s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 0.0)
            preempt.add_metric(label, s.preemptions)
            lost.add_metric(label, s.lost_tokens)
            switches.add_metric(label, s.switches)
            if s.rounds is not None:
                sp.add_metric([s.instance, "admitted"], s.rounds.sp_admitted)
                sp.add_metric([s.instance, "parked"], s.rounds.sp_parked)
                for reason, n in s.rounds.deadline_risk.items():
                    risk.add_metric([s.instance, reason], n)
        yield from (waiting, running, used, total, usage, preempt, lost, switches, sp, risk)


class RouterCollector:
    """Scrape-time counters from the session-aware router: leases, returns, opens, decisions."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def collect(self) -> Iterator[Metric]:
        st = self._router.stats
        leases = CounterMetricFamily("talaria_router_leases", "Soft reservations by outcome", labels=["outcome"])
        for outcome, n in (("hit", st.lease_hits), ("miss", st.lease_misses), ("expired", st.lease_expiries)):
            leases.add_metric([outcome], n)
        returns = CounterMetricFamily("talaria_router_returns", "Calls of known sessions, and how many went "
                                      "back to their last instance", labels=["same_instance"])
        returns.add_metric(["true"], st.same_instance_returns)
        returns.add_metric(["false"], st.returns - st.same_instance_returns)
        opens = CounterMetricFamily("talaria_router_avoidable_model_opens", "Placements that open a model "
                                    "another instance holds")
        opens.add_metric([], st.avoidable_opens)
        decisions = CounterMetricFamily("talaria_router_decisions", "Routing decisions by reason", labels=["reason"])
        for reason, n in st.by_reason().items():
            decisions.add_metric([reason], n)
        yield from (leases, returns, opens, decisions)


class SwitchPathCollector:
    """Model switches by path (full_d2d, partial, h2d_only), counted from the event log's `switch`
    events; every path of every cold instance is listed, zeros included, so a dashboard's series
    exist before the first switch."""

    def __init__(self, stats: Callable[[], Iterable[InstanceStats]], events: EventLog) -> None:
        self._stats = stats
        self.counts: dict[tuple[str, str], int] = {}  # (instance, path) -> switches
        events.tap(self._count)

    def _count(self, event: Event) -> None:
        if event.kind is EventKind.SWITCH:
            key = (event.instance, str(event.data.get("path")))
            self.counts[key] = self.counts.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("talaria_switches", "Model switches by path", labels=["instance", "path"])
        try:
            cold = [s.instance for s in self._stats() if s.pool is Pool.COLD]
        except Exception:  # a scrape must not fail because one source did
            log.exception("supervisor.stats() failed during a /metrics scrape")
            cold = []
        counts = {**{(i, p.value): 0 for i in cold for p in SwitchPath}, **self.counts}
        for (instance, path), n in sorted(counts.items()):
            family.add_metric([instance, path], n)
        yield family


class PeerCollector:
    """The peer set at scrape time: peers by state, and its changes (`peer` events) by op."""

    def __init__(self, peers: PeerSet) -> None:
        self._peers = peers

    def collect(self) -> Iterator[Metric]:
        states = GaugeMetricFamily("talaria_peers", "Peer nodes by state (joining, up, down)", labels=["state"])
        for state, n in self._peers.counts().items():
            states.add_metric([state], n)
        changes = CounterMetricFamily("talaria_peer_changes", "Peer set changes: up, down, left", labels=["op"])
        for op, n in self._peers.changes.items():
            changes.add_metric([op], n)
        yield from (states, changes)


# (_CallSeries attribute, metric name, help) of what the gateway counts per (model, instance)
CALL_HISTOGRAMS = (("e2e", "talaria_e2e_latency_seconds", "Time from request arrival to the last token"),
                   ("ttft", "talaria_ttft_seconds", "Time from request arrival to the first token"),
                   ("tpot", "talaria_time_per_output_token_seconds", "Mean gap between output tokens of a call"))
CALL_COUNTERS = (("prompt", "talaria_prompt_tokens", "Prompt tokens of finished calls"),
                 ("completion", "talaria_completion_tokens", "Generated tokens of finished calls"),
                 ("cached", "talaria_cached_prompt_tokens", "Prompt tokens served from the prefix cache"))


class _Buckets:
    """One histogram series as plain numbers: `counts[i]` holds the observations in bucket i alone
    (the last is +Inf); the cumulative counts Prometheus wants are summed at scrape time."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # bucket "le b" holds value == b
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        edges = [*(floatToGoString(b) for b in self.bounds), "+Inf"]
        return list(zip(edges, accumulate(self.counts), strict=True))


class _CallSeries:
    """What the gateway counts for one (model, instance)."""

    __slots__ = ("cached", "completion", "e2e", "prompt", "tpot", "ttft")

    def __init__(self) -> None:
        self.e2e, self.ttft, self.tpot = _Buckets(E2E_BUCKETS), _Buckets(TTFT_BUCKETS), _Buckets(TPOT_BUCKETS)
        self.prompt = self.completion = self.cached = 0


class GatewayCollector:
    """The gateway's own counters, kept as plain numbers the event loop updates (prometheus-client's
    metrics take a lock per update, eight per call) and turned into metric families at scrape time."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}  # (endpoint, status) -> requests
        self.calls: dict[tuple[str, str], _CallSeries] = {}  # (model, instance) -> finished calls

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("talaria_requests", "HTTP requests by endpoint and status",
                                       labels=["endpoint", "status"])
        for (endpoint, status), n in self.requests.items():
            requests.add_metric([endpoint, str(status)], n)
        labels = ["model", "instance"]
        families = []
        for attr, name, doc in CALL_HISTOGRAMS:
            family = HistogramMetricFamily(name, doc, labels=labels)
            for key, series in self.calls.items():
                h = getattr(series, attr)
                family.add_metric(list(key), h.cumulative(), h.total)
            families.append(family)
        for attr, name, doc in CALL_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=labels)
            for key, series in self.calls.items():
                family.add_metric(list(key), getattr(series, attr))
            families.append(family)
        yield requests
        yield from families


class GatewayMetrics:
    """The gateway's metrics; `render` produces the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, stats: Callable[[], Iterable[InstanceStats]], router: Router | None = None,
                 peers: PeerSet | None = None, events: EventLog | None = None) -> None:
        self.registry = CollectorRegistry()
        self._own = GatewayCollector()
        self.registry.register(self._own)
        self.registry.register(InstanceStatsCollector(stats))
        if router is not None:
            self.registry.register(RouterCollector(router))
        if peers is not None:
            self.registry.register(PeerCollector(peers))
        if events is not None:
            self.registry.register(SwitchPathCollector(stats, events))

    def count_request(self, endpoint: str, status: int) -> None:
        requests = self._own.requests
        requests[endpoint, status] = requests.get((endpoint, status), 0) + 1

    def observe_call(self, model: str, instance: str, arrival: float, first_token_at: float | None,
                     finished_at: float, usage: Usage) -> None:
        """Record one call that finished normally; times are from the gateway's monotonic clock."""
        series = self._own.calls.get((model, instance))
        if series is None:
            series = self._own.calls[model, instance] = _CallSeries()
        series.e2e.observe(finished_at - arrival)
        if first_token_at is not None:
            series.ttft.observe(first_token_at - arrival)
            if usage.completion_tokens > 1:
                series.tpot.observe((finished_at - first_token_at) / (usage.completion_tokens - 1))
        series.prompt += usage.prompt_tokens
        series.completion += usage.completion_tokens
        series.cached += usage.cached_tokens

    def render(self) -> bytes:
        return generate_latest(self.registry)
