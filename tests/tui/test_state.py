"""DashboardState: event records and telemetry bodies folded into what the panels show."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from talaria.tui.state import DashboardState
from tests.tui.events import DOC_ROUND, event, lease, switch

FIXTURES = Path(__file__).parent / "fixtures"


def folded(*events: dict) -> DashboardState:
    state = DashboardState()
    for e in events:
        state.apply_event(e)
    return state


def test_an_installed_lease_counts_down_and_a_consumed_one_is_gone():
    state = folded(lease(1, 100.0, "install", "s1", t_exp=101.0, kv_tokens=57))
    (live,) = state.leases.live()
    assert (live.session, live.model, live.instance, live.kv_tokens) == ("s1", "tiny-llama", "cold-0", 57)
    assert live.remaining(100.25) == pytest.approx(0.75)
    assert live.fraction(100.25) == pytest.approx(0.75)
    assert live.remaining(102.0) == 0.0  # past t_exp but not yet swept by the router: still listed, at 0
    state.apply_event(lease(2, 100.5, "consume", "s1"))
    assert state.leases.live() == []
    assert state.leases.ops == {"install": 1, "consume": 1}


def test_expired_and_discarded_leases_are_gone_and_counted():
    state = folded(lease(1, 1.0, "install", "a", t_exp=2.0, kv_tokens=16),
                   lease(2, 1.1, "install", "b", model="tiny-qwen3", t_exp=2.1, kv_tokens=32),
                   lease(3, 1.2, "install", "c", t_exp=2.2, kv_tokens=48))
    assert [x.session for x in state.leases.live()] == ["a", "b", "c"]  # soonest expiry first
    state.apply_event(lease(4, 2.05, "expire", "a"))
    state.apply_event(lease(5, 2.06, "discard", "b", model="tiny-qwen3", reason="prefix-lost"))
    assert [x.session for x in state.leases.live()] == ["c"]
    assert state.leases.ops["expire"] == 1 and state.leases.discards == {"prefix-lost": 1}


def test_a_lease_is_per_session_and_model():
    state = folded(lease(1, 1.0, "install", "s", t_exp=2.0), lease(2, 1.0, "install", "s", model="tiny-qwen3",
                                                                   t_exp=2.0))
    state.apply_event(lease(3, 1.5, "consume", "s", model="tiny-qwen3"))
    assert [(x.session, x.model) for x in state.leases.live()] == [("s", "tiny-llama")]


def test_switches_are_counted_by_path_once_each_even_when_telemetry_repeats_them():
    records = [switch(1, 1.0, "partial", 4.0), switch(2, 2.0, "full_d2d", 1.0, "tiny-qwen3", "tiny-llama"),
               switch(3, 3.0, "partial", 8.0), switch(4, 4.0, "h2d_only", 20.0, "tiny-qwen3", "tiny-llama")]
    state = folded(*records)
    body = {"time": 5.0, "instances": {"cold-0": {"healthy": True, "in_flight": 0, "stats": {
        "instance": "cold-0", "waiting": 0, "running": 0, "kv_pages_used": 0, "kv_pages_total": 10, "version": 1,
        "pool": "cold", "last_switches": [{k: v for k, v in r.items() if k not in ("seq", "t", "instance", "kind")}
                                          for r in records[1:]]}}}}
    state.apply_telemetry(body)
    assert state.switches.counts == {"partial": 2, "full_d2d": 1, "h2d_only": 1}
    assert state.switches.percentile("partial", 0.5) == 4.0
    assert state.switches.percentile("partial", 1.0) == 8.0
    assert state.switches.percentile("full_d2d", 0.5) == 1.0
    newest = state.switches.recent(2)
    assert [(s.path, s.t) for s in newest] == [("h2d_only", 4.0), ("partial", 3.0)]
    # the slowest rank's phases (rank 1 holds the record's total) and bytes
    assert newest[0].phase_ms == pytest.approx((2.0, 12.0, 2.0, 2.0, 2.0)) and newest[0].staged_bytes == 4096


def test_a_switch_telemetry_showed_first_gets_its_time_from_the_event():
    state = DashboardState()
    record = switch(9, 7.5, "partial", 3.0)
    data = {k: v for k, v in record.items() if k not in ("seq", "t", "instance", "kind")}
    state.switches.add("cold-0", data)
    state.apply_event(record)
    assert state.switches.counts == {"partial": 1}
    assert [s.t for s in state.switches.recent(5)] == [7.5]


def test_rounds_fold_per_instance_and_cold_instances_come_from_the_events():
    state = folded(*DOC_ROUND, event("route", 7, 1.1, "router", request="r", session="s1", model="a", target="hot-0",
                                     reason="ranked"))
    assert state.cold_instances() == ["inst0"]
    assert state.timeline("inst0").view(now=1.0).number == 1
    assert state.instances["inst0"].active_model == "a"


def test_sessions_newest_first_with_their_kv_from_telemetry():
    state = folded(event("route", 1, 1.0, "router", request="r1", session="old", model="smollm2", target="hot-0",
                         reason="ranked"),
                   event("route", 2, 2.0, "router", request="r2", session="new", model="smollm2", target="hot-0",
                         reason="ranked"),
                   event("route", 3, 3.0, "router", request="r3", session="old", model="smollm2", target="hot-0",
                         reason="lease-hit"),
                   event("route", 4, 3.5, "router", request="r4", session=None, model="smollm2", target="hot-0",
                         reason="ranked"))
    assert [(r.session, r.reason) for r in state.recent_sessions(5)] == [("old", "lease-hit"), ("new", "ranked")]
    state.apply_telemetry(json.loads((FIXTURES / "telemetry.json").read_text()))
    assert state.instances["hot-0"].session_kv("chat-2") == {"session": "chat-2", "model": "smollm2", "kv_tokens": 16,
                                                            "location": "device", "device_tokens": 16,
                                                            "host_tokens": 16}


def test_telemetry_gives_models_their_state_and_queues():
    state = DashboardState()
    state.apply_telemetry(json.loads((FIXTURES / "telemetry.json").read_text()))
    assert state.instance_names() == ["hot-0", "cold-0"]
    assert state.cold_instances() == ["cold-0"]
    rows = state.instances["cold-0"].model_rows()
    assert [(r.model, r.state, r.waiting, r.running) for r in rows] == [("tiny-llama", "staged", 0, 0),
                                                                       ("tiny-qwen3", "active", 0, 1)]
    assert rows[0].coverage == pytest.approx(0.0906, abs=1e-4)


def test_an_older_snapshot_does_not_replace_a_newer_one():
    body = json.loads((FIXTURES / "telemetry.json").read_text())
    state = DashboardState()
    state.apply_telemetry(body)
    stale = json.loads(json.dumps(body))
    stale["instances"]["cold-0"]["stats"]["version"] -= 1
    stale["instances"]["cold-0"]["stats"]["active_model"] = "tiny-llama"
    state.apply_telemetry(stale)
    assert state.instances["cold-0"].active_model == "tiny-qwen3"


def test_a_restart_forgets_the_event_log_but_not_the_instances():
    state = folded(*DOC_ROUND, lease(7, 1.0, "install", "s1", t_exp=2.0), switch(8, 1.5, "partial", 2.0))
    state.reset_events()
    assert (state.last_seq, state.events, state.leases.live(), dict(state.switches.counts)) == (0, 0, [], {})
    assert state.timelines == {} and "inst0" in state.instances


def test_a_record_missing_a_field_is_skipped_and_counted():
    broken = switch(1, 1.0, "partial", 2.0)
    del broken["to_model"]
    state = folded(broken, lease(2, 1.0, "install", "s1", t_exp=2.0))
    assert state.malformed == 1 and state.last_seq == 2 and len(state.leases.live()) == 1


def test_without_telemetry_the_events_say_which_model_is_active_and_nothing_more():
    state = folded(event("route", 1, 1.0, "router", request="r1", session="s", model="tiny-qwen3", target="cold-0",
                         reason="ranked"),
                   event("kv_checkpoint", 2, 1.5, model="tiny-llama", seq_id=0, pages_saved=1, pages_published=1))
    rows = state.instances["cold-0"].model_rows()
    assert [(r.model, r.state, r.waiting) for r in rows] == [("tiny-qwen3", "?", None), ("tiny-llama", "active", None)]
    state.apply_event(switch(3, 2.0, "partial", 1.0))
    assert state.instances["cold-0"].active_model == "tiny-qwen3"


def test_identical_switch_events_are_two_switches():
    state = folded(switch(1, 1.0, "full_d2d", 2.0), switch(2, 3.0, "full_d2d", 2.0))  # a simulator's exact costs
    assert state.switches.counts == {"full_d2d": 2}


def test_a_snapshot_this_version_cannot_read_keeps_the_last_good_one():
    body = json.loads((FIXTURES / "telemetry.json").read_text())
    state = DashboardState()
    state.apply_telemetry(body)
    newer = json.loads(json.dumps(body))
    stats = newer["instances"]["cold-0"]["stats"]
    stats["version"] += 1
    stats["queues"][0]["priority"] = 1  # a field ModelQueue does not know
    state.apply_telemetry(newer)
    assert state.malformed == 1 and state.instances["cold-0"].stats.version == stats["version"] - 1
    assert state.instances["hot-0"].stats is not None


PEERS = {"dns": "talaria-peers:8001", "interval_s": 5.0, "lookup_failed": None, "leaving": [], "members": [
    {"url": "http://10.0.0.2:8001", "source": "dns", "state": "up", "why": None, "instances": 2, "healthy_instances": 2},
    {"url": "http://10.0.0.3:8001", "source": "static", "state": "down", "why": "ConnectError: refused",
     "instances": 1, "healthy_instances": 0}]}


def test_the_peer_set_comes_from_telemetry_and_peer_events_keep_it_between_bodies():
    state = DashboardState()
    state.apply_telemetry({"time": 1.0, "instances": {}, "router": {"peers": PEERS}})
    assert state.peer_dns == "talaria-peers:8001"
    assert [(p.url, p.source, p.state, p.healthy, p.instances) for p in state.peers.values()] == [
        ("http://10.0.0.2:8001", "dns", "up", 2, 2), ("http://10.0.0.3:8001", "static", "down", 0, 1)]
    state.apply_event(event("peer", 1, 2.0, "router", op="down", peer="http://10.0.0.2:8001", source="dns",
                            why="ReadTimeout: "))
    state.apply_event(event("peer", 2, 2.1, "router", op="left", peer="http://10.0.0.3:8001", source="static",
                            why="no longer resolves"))
    state.apply_event(event("peer", 3, 2.2, "router", op="up", peer="http://10.0.0.4:8001", source="dns", why=None))
    assert [(p.url, p.state, p.why, p.instances) for p in state.peers.values()] == [
        ("http://10.0.0.2:8001", "down", "ReadTimeout: ", 2), ("http://10.0.0.4:8001", "up", None, None)]
