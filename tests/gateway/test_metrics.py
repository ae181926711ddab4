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


def test_switches_are_counted_by_path_from_the_event_log_every_path_of_a_cold_instance_listed():
    from talaria.config.schema import Pool
    from talaria.contracts.events import Event, EventKind
    from talaria.contracts.telemetry import InstanceStats
    from talaria.node.event_log import EventLog

    events = EventLog()
    cold = InstanceStats("cold-0", 0, 0, 0, 8, pool=Pool.COLD)
    hot = InstanceStats("hot-0", 0, 0, 0, 8, pool=Pool.HOT)
    m = GatewayMetrics(lambda: [cold, hot], events=events)
    events.append([Event(1.0, "cold-0", EventKind.SWITCH, {"path": "partial"}),
                   Event(2.0, "cold-0", EventKind.SWITCH, {"path": "partial"}),
                   Event(2.5, "cold-0", EventKind.ROUND, {"round": 1}),
                   Event(3.0, "cold-0", EventKind.SWITCH, {"path": "full_d2d"})])
    switches = {dict(labels)["path"]: v for (name, labels), v in samples(m).items() if name == "talaria_switches_total"}
    assert switches == {"full_d2d": 1, "partial": 2, "h2d_only": 0}  # hot-0 never switches: not listed


def test_the_peer_set_is_counted_by_state_and_its_changes_by_op():
    import asyncio

    from talaria.config.schema import RouterConfig, ServerConfig
    from talaria.routing.peer_set import PeerSet
    from talaria.routing.router import Router

    router = Router(RouterConfig(), lambda: 0.0, lambda kind, **data: None)
    peers = PeerSet(RouterConfig(peer_dns="peers:9"), ServerConfig(), router, router.clock, [], "me",
                    lambda name, port: asyncio.sleep(0, ["192.0.2.1", "192.0.2.2"]))
    asyncio.run(peers.discover())
    peers.links[0].unreachable("ConnectError: refused")
    s = {(name, frozenset(labels)): v for (name, labels), v in samples(GatewayMetrics(list, router, peers)).items()}
    assert s[("talaria_peers", frozenset({("state", "joining")}))] == 1
    assert s[("talaria_peers", frozenset({("state", "down")}))] == 1
    assert s[("talaria_peers", frozenset({("state", "up")}))] == 0
    assert s[("talaria_peer_changes_total", frozenset({("op", "down")}))] == 1
