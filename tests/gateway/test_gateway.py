"""HTTP shape of the gateway against FakeEchoSupervisor: OpenAI JSON and SSE, errors, auth, limits."""

import json

import pytest
from starlette.testclient import TestClient

from talaria.config.schema import RouterConfig, RouterPolicy
from talaria.gateway.gateway import create_app

from .fakes import MODEL, FakeEchoGroup, FakeEchoSupervisor


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def client_for(sup: FakeEchoSupervisor, **kw) -> TestClient:
    ids = iter(f"id{i}" for i in range(1_000_000))
    kw.setdefault("clock", lambda: 42.25)
    app = create_app(sup, wall_clock=lambda: 1_700_000_000.5, new_id=lambda: next(ids), **kw)
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture
def sup():
    return FakeEchoSupervisor()


@pytest.fixture
def client(sup):
    return client_for(sup)


def sse_events(text: str) -> list:
    assert text.endswith("\n\n")
    events = [block for block in text.split("\n\n") if block]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def assert_openai_error(resp, status, code=None, param=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code and body["error"]["param"] == param
    assert "Traceback" not in resp.text
    return body["error"]


def test_completion_non_streaming(client, sup):
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 7})
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "cmpl-id0"
    assert resp.json() == {
        "id": "cmpl-id0", "object": "text_completion", "created": 1_700_000_000, "model": MODEL,
        "choices": [{"index": 0, "text": "abcabca", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10,
                  "prompt_tokens_details": {"cached_tokens": 0}},
    }
    call = sup.groups[0].calls[0]
    assert call.request_id == "cmpl-id0" and call.prompt_token_ids == tuple(b"abc")
    assert call.enqueue_time == 42.25  # the node's monotonic clock, not the wall clock
    assert sup.groups[0].closed == ["cmpl-id0"]


def test_chat_non_streaming_eos_is_stop_and_not_in_text(client, sup):
    sup.groups[0].eos_after = 3
    sup.groups[0].cached_tokens = 4
    resp = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    body = resp.json()
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-id0"
    # the echo of the templated prompt "<|im_start|>user..." -> first 3 bytes, then EOS (not in the text)
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "<|i"},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"]["completion_tokens"] == 4 and body["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}


def test_chat_streaming_exact_sse_format(client):
    resp = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    head = {"id": "chatcmpl-id0", "object": "chat.completion.chunk", "created": 1_700_000_000, "model": MODEL}
    assert chunks == [
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "<"}, "logprobs": None, "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "|"}, "logprobs": None, "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]},
    ]


def test_completion_streaming_with_usage(client):
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 3, "stream": True,
                                                "stream_options": {"include_usage": True}})
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["a", "b", "a", ""]
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}


def test_stop_string_ends_call_and_closes_instance_stream(client, sup):
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "abcSTOPdef", "max_tokens": 50,
                                                "stop": ["STOP"], "stream": True})
    chunks = [json.loads(e) for e in sse_events(resp.text)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    group = sup.groups[0]
    assert group.closed == ["cmpl-id0"] and group.completed == []  # consumer stopped early
    assert group.in_flight == 0
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "abcSTOPdef", "max_tokens": 50,
                                                "stop": "ST"})
    assert resp.json()["choices"][0]["text"] == "abc" and resp.json()["choices"][0]["finish_reason"] == "stop"


def test_instance_failed_non_streaming_is_503(client, sup):
    sup.groups[0].fail_after = 2
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 5})
    err = assert_openai_error(resp, 503, code="instance_failed")
    assert "hot0 died" in err["message"] and resp.headers["retry-after"]


def routed_in_flight(client: TestClient) -> int:
    return sum(v.in_flight for v in client.app.state.gateway.dispatcher.router.views.values())


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_that_fails_still_releases_its_routing_state(client, sup, stream):
    sup.groups[0].fail_after = 2
    client.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 5, "stream": stream})

    def broken(ids, skip_special_tokens=True):
        raise RuntimeError("a bug in detokenizing")

    sup.groups[0].fail_after = None
    sup.tokenizer(MODEL).decode = broken  # not an instance failure: a bug of ours, mid-call
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 5, "stream": stream})
    assert resp.status_code == (200 if stream else 500)  # a stream reports it in-band
    assert routed_in_flight(client) == 0 and sup.groups[0].in_flight == 0


def test_instance_failed_streaming_is_sse_error_then_close(client, sup):
    sup.groups[0].fail_after = 2
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 5, "stream": True})
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert "[DONE]" not in events
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["a", "b"]
    last = json.loads(events[-1])
    assert last["error"]["code"] == "instance_failed" and set(last["error"]) == {"message", "type", "param", "code"}


def test_no_healthy_instance_is_503_with_retry_after(client, sup):
    sup.groups[0].healthy = False
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "ab"})
    assert_openai_error(resp, 503, code="instance_unavailable")
    assert int(resp.headers["retry-after"]) > 0


@pytest.mark.parametrize("raw, fragment", [
    (b"{not json", "not valid JSON"),
    (b"", "empty"),
    (b'{"model": "echo", "prompt": "a", "temperature": NaN}', "NaN"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
])
def test_malformed_json_is_400(client, raw, fragment):
    resp = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    err = assert_openai_error(resp, 400)
    assert fragment in err["message"]


def test_wrong_type_is_400_with_param(client):
    resp = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                     "max_tokens": "many"})
    assert_openai_error(resp, 400, param="max_tokens")


def test_unknown_model_is_404(client):
    resp = client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert_openai_error(resp, 404, code="model_not_found", param="model")


def test_body_over_limit_by_content_length_and_by_bytes_read():
    client = client_for(FakeEchoSupervisor(max_body_bytes=100))
    big = json.dumps({"model": MODEL, "prompt": "x" * 200}).encode()
    assert_openai_error(client.post("/v1/completions", content=big), 413, code="request_too_large")
    # chunked upload without Content-Length: the limit is enforced on the bytes actually read
    resp = client.post("/v1/completions", content=iter([big[:60], big[60:]]))
    assert "content-length" not in resp.request.headers
    assert_openai_error(resp, 413, code="request_too_large")
    ok = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    assert client.post("/v1/completions", content=iter([ok])).status_code == 200


def test_auth_required_on_v1_only():
    client = client_for(FakeEchoSupervisor(api_key="sekret"))
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert_openai_error(client.post("/v1/completions", json=body), 401, code="missing_api_key")
    resp = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
    assert_openai_error(resp, 401, code="invalid_api_key")
    assert_openai_error(client.get("/v1/models"), 401, code="missing_api_key")
    ok = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_unknown_route_and_method_are_openai_shaped(client):
    assert_openai_error(client.get("/v1/nothing"), 404)
    assert_openai_error(client.get("/v1/completions"), 405)


def test_models_lists_served_models(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert body["data"] == [{"id": MODEL, "object": "model", "created": 1_700_000_000, "owned_by": "talaria",
                             "max_model_len": 128}]


def test_health_reports_each_instance():
    sup = FakeEchoSupervisor([FakeEchoGroup("hot0"), FakeEchoGroup("cold0", in_flight=2)])
    client = client_for(sup)
    resp = client.get("/health")
    assert resp.status_code == 200 and resp.json()["status"] == "ok"
    sup.groups[1].healthy, sup.groups[1].state, sup.groups[1].restarts = False, "restarting", 3
    sup.groups[1].last_failure = "lost a worker process (exit codes [-9, None])"
    resp = client.get("/health")
    assert resp.status_code == 503
    assert resp.json()["instances"] == {
        "hot0": {"healthy": True, "state": "ready", "in_flight": 0, "restarts": 0, "last_failure": None},
        "cold0": {"healthy": False, "state": "restarting", "in_flight": 2, "restarts": 3,
                  "last_failure": "lost a worker process (exit codes [-9, None])"}}


def test_metrics_after_a_call(client, sup):
    client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 4})
    client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": "x"})
    text = client.get("/metrics").text
    assert 'talaria_e2e_latency_seconds_count{instance="hot0",model="echo"} 1.0' in text
    assert 'talaria_ttft_seconds_count{instance="hot0",model="echo"} 1.0' in text
    assert 'talaria_time_per_output_token_seconds_count{instance="hot0",model="echo"} 1.0' in text
    assert 'talaria_completion_tokens_total{instance="hot0",model="echo"} 4.0' in text
    assert 'talaria_prompt_tokens_total{instance="hot0",model="echo"} 3.0' in text
    assert 'talaria_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
    assert 'talaria_requests_total{endpoint="/v1/completions",status="400"} 1.0' in text
    assert 'talaria_num_requests_waiting{instance="hot0"} 1.0' in text
    assert 'talaria_kv_usage_ratio{instance="hot0"} 0.25' in text


def test_session_sticky_routing_through_http():
    clock = Clock()
    a, b = FakeEchoGroup("a"), FakeEchoGroup("b")
    sup = FakeEchoSupervisor([a, b], router=RouterConfig(lease_s=1.0, policy=RouterPolicy.SESSION_STICKY))
    client = client_for(sup, clock=clock)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    client.post("/v1/completions", json=body, headers={"X-Session-Id": "s1"})
    assert len(a.calls) == 1 and a.calls[0].session_id == "s1"
    a.in_flight = 3  # a is busier now, but s1 finished there within the lease
    client.post("/v1/completions", json={**body, "session_id": "s1"})
    assert len(a.calls) == 2
    client.post("/v1/completions", json=body)  # no session: least-pressure
    assert len(b.calls) == 1
    clock.now += 1.5  # lease expired
    client.post("/v1/completions", json=body, headers={"X-Session-Id": "s1"})
    assert len(b.calls) == 2


def test_unexpected_error_is_500_json_without_traceback(sup, client):
    def broken(model):
        raise RuntimeError("secret internals")

    sup.tokenizer = broken
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    err = assert_openai_error(resp, 500)
    assert "secret" not in resp.text and "cmpl-id0" in err["message"]


def test_a_client_without_session_ids_is_recognised_by_its_conversation():
    clock = Clock()
    a, b = FakeEchoGroup("a"), FakeEchoGroup("b")
    sup = FakeEchoSupervisor([a, b], router=RouterConfig(lease_s=1.0, policy=RouterPolicy.SESSION_STICKY),
                             max_position=1024)
    client = client_for(sup, clock=clock)
    messages = [{"role": "user", "content": "list the files"}]
    first = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4})
    reply = first.json()["choices"][0]["message"]["content"]
    assert len(a.calls) == 1 and a.calls[0].session_id.startswith("auto-")
    a.in_flight = 3  # a is busier: only the session's lease keeps it there
    follow_up = [*messages, {"role": "assistant", "content": reply},
                 {"role": "tool", "tool_call_id": "call_1", "content": "a.py b.py"}]
    client.post("/v1/chat/completions", json={"model": MODEL, "messages": follow_up, "max_tokens": 4})
    assert len(a.calls) == 2 and a.calls[1].session_id == a.calls[0].session_id
    other = [{"role": "user", "content": "something else"}]  # a new conversation: a new session
    client.post("/v1/chat/completions", json={"model": MODEL, "messages": other, "max_tokens": 4})
    assert len(b.calls) == 1 and b.calls[0].session_id != a.calls[0].session_id


@pytest.mark.parametrize("raw, param", [
    (b'{"model": "echo", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    (b'{"model": "echo", "prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt[1]"),
    (b'{"model": "echo", "prompt": "a", "\\ud83dx": 1}', "\\ud83dx"),
])
def test_a_lone_surrogate_is_a_400_naming_where_it_is(client, raw, param):
    raw = raw.replace(b'"echo"', json.dumps(MODEL).encode())
    err = assert_openai_error(client.post("/v1/completions", content=raw), 400, param=param)
    assert "surrogate" in err["message"]


def test_a_paired_surrogate_escape_is_a_character(client):
    raw = json.dumps({"model": MODEL, "prompt": "smile \U0001F600", "max_tokens": 2}, ensure_ascii=True)
    assert "\\ud83d\\ude00" in raw
    assert client.post("/v1/completions", content=raw).status_code == 200
