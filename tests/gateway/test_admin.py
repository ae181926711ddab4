"""`talaria.gateway.admin`: the telemetry envelope, the event stream and forced switches, over HTTP.

Against `FakeEchoSupervisor` (in-process instances with a real event log); the forced switch of a
real engine group is covered end to end by the dashboard's live test."""

from __future__ import annotations

import dataclasses

import pytest
from starlette.testclient import TestClient

from talaria.config.schema import ApiKeyConfig, ServerConfig
from talaria.contracts.call import InstanceReady
from talaria.contracts.events import Event, EventKind
from talaria.contracts.profile_file import parse_profile
from talaria.contracts.telemetry import NodeTelemetry
from talaria.gateway.gateway import create_app
from tests.gateway.fakes import MODEL, FakeEchoGroup, FakeEchoSupervisor
from tests.routing.test_router import PROFILE, snapshot

PROFILE_ECHO = PROFILE.with_model(dataclasses.replace(PROFILE.models["m"], name=MODEL))


def client_for(node: FakeEchoSupervisor, host: str = "127.0.0.1") -> TestClient:
    """A client from `host`: without an admin or peer key, the admin routes answer loopback only."""
    return TestClient(create_app(node, clock=lambda: 7.5), raise_server_exceptions=False, client=(host, 50000))


@pytest.fixture
def node() -> FakeEchoSupervisor:
    up, down = FakeEchoGroup("hot0", in_flight=2), FakeEchoGroup("hot1", healthy=False, restarts=3)
    up.ready = InstanceReady("hot0", (MODEL,), 100, 0.1, profile=PROFILE_ECHO)
    up.stats = snapshot("hot0", active=MODEL, version=4)
    return FakeEchoSupervisor([up, down])


def test_telemetry_is_one_envelope_that_reads_back_whole(node):
    body = client_for(node).get("/talaria/telemetry").json()
    t = NodeTelemetry.from_dict(body)
    assert t.time == 7.5 and t.unreadable == ()
    assert list(t.instances) == ["hot0", "hot1"]
    hot0, hot1 = t.instances["hot0"], t.instances["hot1"]
    assert (hot0.healthy, hot0.in_flight, hot0.models, hot0.restarts) == (True, 2, (MODEL,), 0)
    assert hot0.stats == node.groups[0].stats  # the snapshot survives JSON
    assert parse_profile(hot0.profile) == PROFILE_ECHO
    assert (hot1.healthy, hot1.stats, hot1.profile, hot1.restarts) == (False, None, None, 3)
    assert t.router["policy"] == node.config.router.policy.value and "leases" in t.router


def test_the_event_stream_replays_from_a_sequence_number(node):
    node.events.append([Event(1.0, "hot0", EventKind.SWITCH, {"to_model": MODEL}),
                        Event(2.0, "router", EventKind.LEASE, {"op": "install"})])
    client = client_for(node)
    with client.stream("GET", "/talaria/events?since=1") as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        line = next(line for line in r.iter_lines() if line)
    assert line.startswith("data: ") and '"seq":2' in line and '"kind":"lease"' in line
    bad = client.get("/talaria/events?since=soon")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"instance": "hot0"}, 400, "instance"),
    ({"instance": "nope", "model": MODEL}, 404, "instance"),
    ({"instance": "hot0", "model": "other"}, 400, "model"),
    ({"instance": "hot0", "model": MODEL}, 503, None),  # this instance cannot switch now: retry later
])
def test_a_forced_switch_names_what_is_wrong(node, body, status, param):
    r = client_for(node).post("/talaria/admin/switch", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    if status == 503:
        assert int(r.headers["retry-after"]) > 0


ADMIN_PATHS = (("GET", "/talaria/events"), ("POST", "/talaria/admin/switch"))
KEYS = ServerConfig(api_keys=(ApiKeyConfig("user-a", "team-a"),), admin_key="adm", peer_key="peer")


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_admin_endpoints_need_the_admin_key_and_telemetry_the_admin_or_peer_key():
    client = client_for(FakeEchoSupervisor(server=KEYS))
    for method, path in (*ADMIN_PATHS, ("GET", "/talaria/telemetry")):
        assert client.request(method, path).status_code == 401
        user = client.request(method, path, headers=bearer("user-a"))
        assert user.status_code == 403 and user.json()["error"]["type"] == "permission_error"
    for method, path in ADMIN_PATHS:
        assert client.request(method, path, headers=bearer("peer")).status_code == 403
    assert client.post("/talaria/admin/switch", headers=bearer("adm"), json={}).status_code == 400  # past the gate
    for key in ("adm", "peer"):
        assert client.get("/talaria/telemetry", headers=bearer(key)).status_code == 200
    assert client.get("/v1/models", headers=bearer("user-a")).status_code == 200
    assert client.get("/v1/models", headers=bearer("adm")).status_code == 401  # the admin key is no user key


def test_without_admin_or_peer_key_the_admin_endpoints_answer_loopback_only():
    node = FakeEchoSupervisor(api_key="sekrit")
    away = client_for(node, host="10.1.2.3")
    for method, path in (*ADMIN_PATHS, ("GET", "/talaria/telemetry")):
        denied = away.request(method, path, headers=bearer("sekrit"))  # a user key changes nothing
        assert denied.status_code == 403 and denied.json()["error"]["code"] == "loopback_only"
    assert client_for(node).get("/talaria/telemetry").status_code == 200
