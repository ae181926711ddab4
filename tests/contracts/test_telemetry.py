"""`talaria.contracts.telemetry`: the node's telemetry envelope reads back what was written."""

from __future__ import annotations

import dataclasses
import json

import pytest

from talaria.config.schema import Pool
from talaria.contracts.telemetry import (
    InstanceStats,
    InstanceTelemetry,
    ModelQueue,
    NodeTelemetry,
    RoundState,
)
from talaria.contracts.vocabulary import KVLocation

STATS = InstanceStats("cold-0", 1, 2, 3, 40, models=("a", "b"), active_model="a", version=9, pool=Pool.COLD,
                      queues=(ModelQueue("a", 1, 2, True), ModelQueue("b", 0, 0, False)),
                      rounds=RoundState(3, 0.5, {"model": "a"}, {"round_over": 1}, 4, 1, ({"round": 2},), 1.6),
                      sessions=({"session": "s", "model": "a", "kv_tokens": 32, "location": KVLocation.HOST,
                                 "device_tokens": 0, "host_tokens": 32},),
                      last_switches=({"path": "partial"},), time=12.5, page_size=16,
                      cost_scale={"a/decode": 1.25}, page_bytes={"a": 4096, "b": 8192},
                      state_bytes={"a": 0, "b": 1000}, state_slots={"a": 0, "b": 6})


def test_an_envelope_survives_json_field_for_field():
    t = NodeTelemetry(3.0, {"cold-0": InstanceTelemetry(True, 2, ("a", "b"), STATS, "[profile]\n", 1),
                            "hot-0": InstanceTelemetry(False, 0, ("m",), None, None)}, {"policy": "full"})
    back = NodeTelemetry.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t
    assert back.instances["cold-0"].stats.pool is Pool.COLD
    assert back.instances["cold-0"].stats.sessions[0]["location"] == KVLocation.HOST


def test_a_snapshot_from_before_the_cache_sizes_reads_with_none_known():
    entry = InstanceTelemetry(True, 0, ("a", "b"), STATS, None).to_dict()
    for key in ("page_bytes", "state_bytes", "state_slots"):
        del entry["stats"][key]
    stats = NodeTelemetry.from_dict({"instances": {"cold-0": entry}}).instances["cold-0"].stats
    assert (stats.page_bytes, stats.state_bytes, stats.state_slots) == ({}, {}, {})
    assert stats == dataclasses.replace(STATS, page_bytes={}, state_bytes={}, state_slots={})


def test_an_entry_this_version_cannot_read_costs_only_itself():
    good = InstanceTelemetry(True, 0, ("a", "b"), STATS, None).to_dict()
    body = {"time": 1.0, "router": {}, "instances": {"ok": good, "bad": {"stats": {"waiting": "many"}},
                                                      "worse": "not an object"}}
    t = NodeTelemetry.from_dict(body)
    assert list(t.instances) == ["ok"] and set(t.unreadable) == {"bad", "worse"}


def test_a_newer_writers_extra_fields_are_ignored():
    entry = InstanceTelemetry(True, 0, ("a",), STATS, None).to_dict()
    entry["stats"]["a_field_from_the_future"] = 1
    entry["shiny"] = True
    t = NodeTelemetry.from_dict({"instances": {"x": entry}})
    assert t.instances["x"].stats == STATS and t.time == 0.0 and t.router == {}


@pytest.mark.parametrize("body", [[], "telemetry", {"instances": []}])
def test_a_body_that_is_no_envelope_is_refused(body):
    with pytest.raises(TypeError, match="not a Talaria telemetry body"):
        NodeTelemetry.from_dict(body)
