"""HTTP shape of `/v1/messages` against FakeEchoSupervisor: Anthropic's errors at every stage (before
the call, during a stream), auth by either header, limits, and stop sequences."""

from __future__ import annotations

import json

import pytest

from talaria.config.schema import RouterConfig, RouterPolicy

from .fakes import MODEL, FakeEchoGroup, FakeEchoSupervisor
from .test_gateway import client_for

ASK = [{"role": "user", "content": "abc"}]


def body(**extra) -> dict:
    return {"model": MODEL, "max_tokens": 5, "messages": ASK, **extra}


def assert_anthropic_error(resp, status: int, kind: str) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()
    assert set(err) == {"type", "error"} and err["type"] == "error" and set(err["error"]) == {"type", "message"}
    assert err["error"]["type"] == kind and "Traceback" not in resp.text
    return err["error"]["message"]


def events(text: str) -> list[tuple[str, dict]]:
    frames = [f.split("\n") for f in text.strip().split("\n\n")]
    assert all(head.startswith("event: ") and data.startswith("data: ") for head, data in frames)
    return [(head.removeprefix("event: "), json.loads(data.removeprefix("data: "))) for head, data in frames]


@pytest.fixture
def sup():
    return FakeEchoSupervisor(max_position=4096)


def test_a_whole_message_and_its_stream(sup):
    sup.groups[0].script = "Hello. END more"
    client = client_for(sup)
    resp = client.post("/v1/messages?beta=true", json=body(max_tokens=50, stop_sequences=["END"]),
                       headers={"anthropic-version": "2023-06-01", "anthropic-beta": "prompt-caching-2024-07-31"})
    m = resp.json()
    assert resp.status_code == 200 and m["id"] == "msg_id0" and resp.headers["x-request-id"] == "msg_id0"
    assert m["content"] == [{"type": "text", "text": "Hello. "}]
    assert (m["stop_reason"], m["stop_sequence"]) == ("stop_sequence", "END")
    streamed = client.post("/v1/messages", json=body(max_tokens=50, stop_sequences=["END"], stream=True))
    assert streamed.headers["content-type"].startswith("text/event-stream")
    evs = events(streamed.text)
    assert [k for k, _ in evs] == ["message_start", "ping", "content_block_start", *["content_block_delta"] * (
        len(evs) - 6), "content_block_stop", "message_delta", "message_stop"]
    assert "".join(d["delta"]["text"] for k, d in evs if k == "content_block_delta") == "Hello. "
    assert evs[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_errors_before_the_call_are_anthropic_shaped():
    sup = FakeEchoSupervisor(max_position=4096, api_key="k", max_body_bytes=2000)
    client = client_for(sup)
    assert_anthropic_error(client.post("/v1/messages", json=body()), 401, "authentication_error")
    assert_anthropic_error(client.post("/v1/messages", json=body(), headers={"x-api-key": "no"}), 401,
                           "authentication_error")
    ok = {"x-api-key": "k"}
    assert client.post("/v1/messages", json=body(), headers=ok).status_code == 200
    assert client.post("/v1/messages", json=body(), headers={"authorization": "Bearer k"}).status_code == 200
    assert_anthropic_error(client.post("/v1/messages", content=b"{oops", headers=ok), 400, "invalid_request_error")
    assert_anthropic_error(client.post("/v1/messages", json=body(model="gpt-9"), headers=ok), 404, "not_found_error")
    big = body(messages=[{"role": "user", "content": "x" * 3000}])
    assert_anthropic_error(client.post("/v1/messages", json=big, headers=ok), 413, "request_too_large")
    assert_anthropic_error(client.post("/v1/messages/count_tokens", json={"model": MODEL}, headers=ok), 400,
                           "invalid_request_error")
    sup.groups[0].healthy = False
    resp = client.post("/v1/messages", json=body(), headers=ok)
    assert_anthropic_error(resp, 503, "overloaded_error")
    assert int(resp.headers["retry-after"]) > 0
    assert "error" in client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK},
                                  headers=ok).json()  # OpenAI's shape stays on the OpenAI routes


def test_a_worker_dying_mid_call_is_an_error_whole_or_in_the_stream(sup):
    sup.groups[0].fail_after = 2
    client = client_for(sup)
    assert "hot0 died" in assert_anthropic_error(client.post("/v1/messages", json=body()), 503, "overloaded_error")
    resp = client.post("/v1/messages", json=body(stream=True))
    evs = events(resp.text)
    assert resp.status_code == 200 and [k for k, _ in evs][:2] == ["message_start", "ping"]
    assert evs[-1][0] == "error" and evs[-1][1]["error"]["type"] == "overloaded_error"
    assert "message_stop" not in [k for k, _ in evs]
    assert sup.groups[0].in_flight == 0


def test_the_session_in_metadata_reaches_the_instance():
    group = FakeEchoGroup("hot0")
    client = client_for(FakeEchoSupervisor([group], max_position=4096))
    client.post("/v1/messages", json=body(metadata={"user_id": "user_1_account_2_session_abc-123"}))
    client.post("/v1/messages", json=body(metadata={"user_id": "user_1_account_2_session_abc-123"}),
                headers={"x-session-id": "from-header"})
    assert [c.session_id for c in group.calls] == ["abc-123", "from-header"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_conversation_without_a_session_id_is_recognised_and_keeps_its_instance(stream):
    """No header, no metadata: call 2 (call 1's messages, its reply with a tool_use block, the
    tool_result) continues call 1's session, and its lease keeps it on call 1's instance."""
    a, b = FakeEchoGroup("a", script='<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'), FakeEchoGroup("b")
    sup = FakeEchoSupervisor([a, b], router=RouterConfig(lease_s=60.0, policy=RouterPolicy.SESSION_STICKY),
                             max_position=4096)
    client = client_for(sup)
    tools = [{"name": "ls", "input_schema": {"type": "object"}}]
    first = client.post("/v1/messages", json=body(max_tokens=100, tools=tools, stream=stream))
    if stream:
        reply = [d["content_block"] for k, d in events(first.text) if k == "content_block_start"]
        reply = [{**block, "input": {}} for block in reply]
    else:
        reply = first.json()["content"]
    assert [blk["type"] for blk in reply] == ["tool_use"] and a.calls[0].session_id.startswith("auto-")
    a.in_flight = 3  # a is busier: only the session's lease keeps it there
    follow_up = [*ASK, {"role": "assistant", "content": reply},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": reply[0]["id"], "content": "a.py"}]}]
    client.post("/v1/messages", json=body(tools=tools, messages=follow_up))
    assert len(a.calls) == 2 and a.calls[1].session_id == a.calls[0].session_id and not b.calls
