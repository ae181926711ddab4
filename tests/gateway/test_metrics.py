"""The gateway's histograms and counters expose what Prometheus expects: cumulative buckets whose
`le` bound includes values equal to it, a count, a sum, and per-(model, instance) token counters."""

from prometheus_client.parser import text_string_to_metric_families

from talaria.contracts.call import Usage
from talaria.gateway.metrics import GatewayMetrics


def samples(metrics: GatewayMetrics) -> dict:
    """(sample name, frozenset of its labels) -> value, from the /metrics text."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def key(name: str, instance: str = "i0", **labels: str) -> tuple:
    return name, frozenset({"model": "m", "instance": instance, **labels}.items())


def test_histograms_are_cumulative_with_inclusive_bounds_and_counters_add_up():
    m = GatewayMetrics(list)
    m.observe_call("m", "i0", 0.0, 0.01, 2.5, Usage(3, 4, 1))  # ttft exactly on the 0.01 bound
    m.observe_call("m", "i0", 10.0, 10.3, 10.5, Usage(5, 1, 0))  # one token: no time per output token
    m.observe_call("m", "i1", 0.0, None, 0.2, Usage(2, 0, 0))  # no first token: e2e only
    m.count_request("/v1/completions", 200)
    m.count_request("/v1/completions", 200)
    m.count_request("/v1/completions", 400)
    s = samples(m)
    assert s[key("talaria_ttft_seconds_bucket", le="0.01")] == 1
    assert s[key("talaria_ttft_seconds_bucket", le="0.25")] == 1
    assert s[key("talaria_ttft_seconds_bucket", le="0.5")] == 2
    assert s[key("talaria_ttft_seconds_bucket", le="+Inf")] == 2
    assert s[key("talaria_ttft_seconds_count")] == 2
    assert abs(s[key("talaria_ttft_seconds_sum")] - 0.31) < 1e-9
    assert s[key("talaria_time_per_output_token_seconds_count")] == 1  # (2.5 - 0.01) / 3
    assert abs(s[key("talaria_time_per_output_token_seconds_sum")] - 0.83) < 1e-9
    assert s[key("talaria_e2e_latency_seconds_count", "i1")] == 1
    assert s[key("talaria_ttft_seconds_count", "i1")] == 0
    assert s[key("talaria_prompt_tokens_total")] == 8 and s[key("talaria_completion_tokens_total")] == 5
    assert s[key("talaria_cached_prompt_tokens_total")] == 1
    requests = {"endpoint": "/v1/completions"}
    assert s[("talaria_requests_total", frozenset({**requests, "status": "200"}.items()))] == 2
    assert s[("talaria_requests_total", frozenset({**requests, "status": "400"}.items()))] == 1
