"""deploy/grafana/talaria.json asks only for series a live node's `/metrics` has.

The node is the test session's shared `talaria up` (the default config, a hot and a cold instance);
one call per model gives the latency histograms their series. Every metric the dashboard's queries
name must be in the scrape with samples, and every label they group or match by must be on it.
Two labels come from Prometheus, not from the node: `pod` (its Kubernetes service discovery) and
`exported_instance`, which is Talaria's `instance` renamed, since `instance` is Prometheus' own
target label.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Server

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "talaria.json"
FROM_PROMETHEUS = {"pod"}
RENAMED = {"exported_instance": "instance"}
METRIC = re.compile(r"\b(talaria_[a-z0-9_]+)(\{[^}]*\})?")
GROUPING = re.compile(r"\bby \(([^)]*)\)")


def queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]


def used() -> dict[str, set[str]]:
    """metric -> the labels the dashboard reads on it (matched, or grouped by in the same query)."""
    found: dict[str, set[str]] = {}
    for expr in queries():
        grouped = {label.strip() for g in GROUPING.findall(expr) for label in g.split(",")}
        for name, matchers in METRIC.findall(expr):
            labels = set(re.findall(r"(\w+)\s*=~?", matchers)) | grouped
            found.setdefault(name, set()).update(RENAMED.get(x, x) for x in labels - FROM_PROMETHEUS - {"le"})
    return found


def scrape(server: Server) -> dict[str, set[str]]:
    """sample name -> the labels its samples carry."""
    text = server.metrics().text
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def test_the_dashboard_covers_what_the_issue_asks_for():
    names = set(used())
    for wanted in ("talaria_ttft_seconds_bucket", "talaria_time_per_output_token_seconds_bucket",
                   "talaria_e2e_latency_seconds_bucket", "talaria_num_requests_waiting", "talaria_kv_pages_used",
                   "talaria_switches_total", "talaria_router_leases_total", "talaria_requests_total",
                   "talaria_peers"):
        assert wanted in names, wanted
    assert all("$pod" in q for q in queries())  # every panel follows the pod picker


def test_every_series_the_dashboard_queries_is_in_a_live_metrics_scrape(server: Server):
    with httpx.Client(timeout=120) as client:
        for model in ("smollm2", "tiny-llama", "tiny-qwen3"):
            r = client.post(server.api + "/completions", json={"model": model, "prompt": "Hello", "max_tokens": 3,
                                                               "temperature": 0})
            assert r.status_code == 200, r.text
    scraped = scrape(server)
    for name, labels in used().items():
        assert name in scraped, f"{name}: the dashboard queries it, /metrics has no sample of it"
        assert labels <= scraped[name], f"{name}: the dashboard reads {sorted(labels - scraped[name])}, not on it"
