"""Prometheus metrics of one gateway, on its own `CollectorRegistry`.

Latency histograms and token counters are updated by the gateway as calls finish; per-instance load
(queue depth, running sequences, KV pages) is read from `supervisor.stats()` at scrape time, so it is
never stale and costs nothing between scrapes. A registry per app (not prometheus-client's global
one) lets several gateways — or a simulator and a live node — share a process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from talaria.contracts.call import Usage
from talaria.contracts.telemetry import InstanceStats
from talaria.router.router import Router

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
            switches.add_metric(label, s.switches)
            if s.rounds is not None:
                sp.add_metric([s.instance, "admitted"], s.rounds.sp_admitted)
                sp.add_metric([s.instance, "parked"], s.rounds.sp_parked)
                for reason, n in s.rounds.deadline_risk.items():
                    risk.add_metric([s.instance, reason], n)
        yield from (waiting, running, used, total, usage, preempt, switches, sp, risk)


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


class GatewayMetrics:
    """The gateway's metrics; `render` produces the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, stats: Callable[[], Iterable[InstanceStats]], router: Router | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = ["model", "instance"]
        self._ttft = Histogram("talaria_ttft_seconds", "Time from request arrival to the first token",
                               labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self._tpot = Histogram("talaria_time_per_output_token_seconds", "Mean gap between output tokens of a call",
                               labels, buckets=TPOT_BUCKETS, registry=self.registry)
        self._e2e = Histogram("talaria_e2e_latency_seconds", "Time from request arrival to the last token",
                              labels, buckets=E2E_BUCKETS, registry=self.registry)
        self._requests = Counter("talaria_requests", "HTTP requests by endpoint and status",
                                 ["endpoint", "status"], registry=self.registry)
        self._prompt = Counter("talaria_prompt_tokens", "Prompt tokens of finished calls", labels,
                               registry=self.registry)
        self._completion = Counter("talaria_completion_tokens", "Generated tokens of finished calls", labels,
                                   registry=self.registry)
        self._cached = Counter("talaria_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                               labels, registry=self.registry)
        # labelled children, looked up once: `labels()` takes a lock and builds a key
        self._counted: dict[tuple[str, int], Counter] = {}  # (endpoint, status) -> its requests counter
        self._series: dict[tuple[str, str], tuple] = {}  # (model, instance) -> its call metrics
        self.registry.register(InstanceStatsCollector(stats))
        if router is not None:
            self.registry.register(RouterCollector(router))

    def count_request(self, endpoint: str, status: int) -> None:
        counter = self._counted.get((endpoint, status))
        if counter is None:
            counter = self._counted[endpoint, status] = self._requests.labels(endpoint, str(status))
        counter.inc()

    def observe_call(self, model: str, instance: str, arrival: float, first_token_at: float | None,
                     finished_at: float, usage: Usage) -> None:
        """Record one call that finished normally; times are from the gateway's monotonic clock."""
        series = self._series.get((model, instance))
        if series is None:
            series = self._series[(model, instance)] = tuple(
                m.labels(model, instance) for m in (self._e2e, self._ttft, self._tpot, self._prompt,
                                                    self._completion, self._cached))
        e2e, ttft, tpot, prompt, completion, cached = series
        e2e.observe(finished_at - arrival)
        if first_token_at is not None:
            ttft.observe(first_token_at - arrival)
            if usage.completion_tokens > 1:
                tpot.observe((finished_at - first_token_at) / (usage.completion_tokens - 1))
        prompt.inc(usage.prompt_tokens)
        completion.inc(usage.completion_tokens)
        cached.inc(usage.cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
