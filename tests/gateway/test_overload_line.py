"""The admission line over HTTP: a new session the node cannot admit gets 429 with its promise in
`Retry-After` (whole seconds) and `retry-after-ms` (exact) on every API, in each API's error shape;
past the line's bound a longer wait; over capacity 503, or 529 `overloaded_error` under
/v1/messages, where Anthropic's clients expect it (docs/api.md, "Overload")."""

from __future__ import annotations

import math

import pytest
from starlette.testclient import TestClient

from talaria.config.schema import RouterConfig, RouterPolicy
from talaria.gateway.gateway import create_app
from talaria.routing import line_turns
from tests.routing.test_dispatcher import ready

from .fakes import MODEL, FakeEchoGroup, FakeEchoSupervisor

ASK = [{"role": "user", "content": "hi"}]
CALLS = {  # path -> a body opening session `s`
    "/v1/chat/completions": lambda s: {"model": MODEL, "messages": ASK, "max_tokens": 4, "session_id": s},
    "/v1/messages": lambda s: {"model": MODEL, "messages": ASK, "max_tokens": 4, "metadata": {"user_id": f"u_session_{s}"}},
    "/v1/responses": lambda s: {"model": MODEL, "input": "hi", "max_output_tokens": 16, "prompt_cache_key": s},
}


def full_node(waiting: int = 100, **router) -> tuple[FakeEchoSupervisor, object]:
    """A node whose one instance has `waiting` calls waiting: new sessions wait past the 2 s target."""
    group = FakeEchoGroup("hot0")
    ready(group, waiting=waiting)
    router.setdefault("line_hold_s", 0.0)  # a 429 however near its turn (the clock here never moves)
    sup = FakeEchoSupervisor([group], router=RouterConfig(policy=RouterPolicy.FULL, **router))
    ids = iter(f"id{i}" for i in range(1_000_000))
    app = create_app(sup, clock=lambda: 50.0, wall_clock=lambda: 1_700_000_000.5, new_id=lambda: next(ids))
    return sup, TestClient(app, raise_server_exceptions=False, client=("127.0.0.1", 50000))  # loopback: telemetry


def promise(resp) -> tuple[int, int]:
    seconds, ms = int(resp.headers["retry-after"]), int(resp.headers["retry-after-ms"])
    assert seconds == max(1, math.ceil(ms / 1000))
    return seconds, ms


@pytest.mark.parametrize("path", sorted(CALLS))
def test_a_new_session_gets_its_place_in_line_as_a_429_in_the_shape_of_its_api(path):
    sup, client = full_node()
    resp = client.post(path, json=CALLS[path]("s1"))
    assert resp.status_code == 429
    body = resp.json()
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    else:
        assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "rate_limit_exceeded"
    assert "number 1 in line" in str(body)
    first = promise(resp)
    again = client.post(path, json=CALLS[path]("s1"))  # it comes back (early): the same place
    assert again.status_code == 429 and "number 1 in line" in str(again.json())
    assert promise(client.post(path, json=CALLS[path]("s2")))[1] >= first[1]  # the next one waits behind it


def test_a_wait_past_two_minutes_is_told_as_two_minutes_to_openai_clients_and_whole_to_anthropic_ones():
    """openai-python obeys a Retry-After of at most 120 s and gives up at once on a longer one; the
    Anthropic SDKs obey any. An OpenAI-shaped 429 asks the client back at 120 s, its place kept (and
    its promise, told in the message); a Messages 429 tells the promise itself."""
    sup, client = full_node(waiting=10_000)  # about 520 s of work queued ahead
    for i, path in enumerate(CALLS):
        resp = client.post(path, json=CALLS[path](f"s{i}"))
        assert resp.status_code == 429
        due = client.get("/talaria/telemetry").json()["router"]["line"]["models"][MODEL][-1]
        assert due["waited_s"] == 0 and due["due_in_s"] > 300
        assert f"expected in within {due['due_in_s']:.1f} s" in str(resp.json())
        told = (120, 120_000) if path != "/v1/messages" else (math.ceil(due["due_in_s"]), round(due["due_in_s"] * 1000))
        assert promise(resp) == told


def test_a_wait_past_ten_minutes_is_over_capacity_once_measured_and_a_kept_place_before():
    """A wait predicted past 600 s is over capacity (503), but not on a prediction priced from the
    paper's session lengths before any session of the model ended: its place is kept and it is
    asked back within 600 s (120 s, told to an OpenAI client)."""
    sup, client = full_node(waiting=100_000)  # about 5,200 s of work queued ahead
    chat = "/v1/chat/completions"
    resp = client.post(chat, json=CALLS[chat]("s1"))
    assert resp.status_code == 429 and promise(resp) == (120, 120_000) and "within 600.0 s" in str(resp.json())
    resp = client.post("/v1/messages", json=CALLS["/v1/messages"]("s2"))
    assert resp.status_code == 429 and promise(resp) == (600, 600_000)
    client.app.state.gateway.dispatcher.load.lengths(MODEL).ended(3)  # a session of the model ended
    resp = client.post(chat, json=CALLS[chat]("s3"))
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "over_capacity"
    line = client.get("/talaria/telemetry").json()["router"]["line"]
    assert [w["session"] for w in line["models"][MODEL]] == ["s1", "s2"] and line["counts"]["over_capacity"] == 1


def test_beyond_the_bound_a_longer_wait_and_over_capacity_is_503_or_529(monkeypatch):
    sup, client = full_node(max_waiting=1)
    chat = "/v1/chat/completions"
    first = promise(client.post(chat, json=CALLS[chat]("s1")))
    resp = client.post(chat, json=CALLS[chat]("s2"))
    assert resp.status_code == 429 and "no place in line" in resp.json()["error"]["message"]
    assert promise(resp)[1] >= first[1]
    monkeypatch.setattr(line_turns, "MAX_PROMISE_S", 0.001)  # every wait is now past what clients wait
    resp = client.post(chat, json=CALLS[chat]("s3"))
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "over_capacity"
    resp = client.post("/v1/messages", json=CALLS["/v1/messages"]("s4"))
    assert resp.status_code == 529 and resp.json()["error"]["type"] == "overloaded_error"
    assert int(resp.headers["retry-after"]) > 0
    line = client.get("/talaria/telemetry").json()["router"]["line"]
    assert line["waiting"] == 1 and line["counts"]["full"] == 3 and line["counts"]["over_capacity"] == 2
    assert [w["session"] for w in line["models"][MODEL]] == ["s1"]


def test_a_client_without_a_session_id_keeps_its_place_by_its_conversation():
    sup, client = full_node()
    chat = "/v1/chat/completions"

    def ask(task: str):
        return client.post(chat, json={"model": MODEL, "max_tokens": 4,
                                       "messages": [{"role": "system", "content": "You are an agent."},
                                                    {"role": "user", "content": task}]})
    assert "number 1 in line" in ask("fix the test").json()["error"]["message"]
    assert "number 2 in line" in ask("write the docs").json()["error"]["message"]
    assert "number 1 in line" in ask("fix the test").json()["error"]["message"]  # the same conversation again
