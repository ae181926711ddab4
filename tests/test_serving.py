"""End to end through the shared `talaria up` on the default config: a real OpenAI client against
real engine workers on loopback — answers, errors, the prefix cache, cancellation and metrics."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from talaria.config.loader import load_config
from tests.conftest import DEFAULT_CONFIG, Server, wait_for

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TINY = "tiny-llama"  # synthetic, byte tokenizer, context 2048, on the TP=2 instance cold-0
TINY_INSTANCE = "cold-0"
CANCEL_DEADLINE_S = 5.0  # a cancelled 1500-token call would otherwise decode for most of a minute


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: Server) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def metric_samples(server: Server) -> dict[tuple[str, frozenset], float]:
    """/metrics as {(sample name, labels): value}."""
    text = server.metrics(timeout=5).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def instance_gauge(server: Server, name: str, instance: str) -> float:
    return metric_samples(server)[(name, frozenset({("instance", instance)}))]


# ---- answers -------------------------------------------------------------------------------

def test_smollm2_chat_knows_the_capital_of_france(client):
    out = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=32)
    assert "Paris" in out.choices[0].message.content
    assert out.usage.prompt_tokens > 0 and out.usage.completion_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_smollm2_chat_streamed_deltas_join_to_the_answer(client):
    chunks = list(client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0,
                                                 max_tokens=32, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
    usage = chunks[-1].usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0


def test_smollm2_legacy_completions(client):
    out = client.completions.create(model="smollm2", prompt="The capital of France is", temperature=0,
                                    max_tokens=8)
    assert "Paris" in out.choices[0].text
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens > 0


# ---- bad requests --------------------------------------------------------------------------

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body, status, param, code", [
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": ', 400, None, None),
    (COMPLETIONS, {"model": "gpt-9", "prompt": "x"}, 404, "model", "model_not_found"),
    (COMPLETIONS, {"model": TINY, "prompt": "a" * 2100}, 400, "prompt", "context_length_exceeded"),
    (COMPLETIONS, {"model": TINY, "prompt": "a" * 2000, "max_tokens": 100}, 400, "max_tokens",
     "context_length_exceeded"),
    (CHAT, {"model": TINY, "messages": MESSAGES, "max_tokens": -1}, 400, "max_tokens", None),
    (CHAT, {"model": TINY, "messages": MESSAGES, "max_tokens": 1.5}, 400, "max_tokens", None),
    (CHAT, {"model": TINY, "messages": MESSAGES, "max_tokens": True}, 400, "max_tokens", None),
    (CHAT, {"model": TINY, "messages": "hi"}, 400, "messages", None),
    (CHAT, {"model": TINY, "messages": MESSAGES, "temperature": "hot"}, 400, "temperature", None),
], ids=["malformed-json", "unknown-model", "prompt-over-context", "prompt-plus-max-tokens-over-context",
        "negative-max-tokens", "fractional-max-tokens", "boolean-max-tokens", "messages-not-a-list",
        "temperature-a-string"])
def test_bad_request_is_openai_error_and_server_keeps_serving(http, path, body, status, param, code):
    resp = http.post(path, content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes) \
        else http.post(path, json=body)
    assert_openai_error(resp, status, param, code)
    assert_still_serving(http)


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_body_over_max_body_bytes_is_413(http, declared):
    limit = load_config(DEFAULT_CONFIG).server.max_body_bytes
    body = b'{"model": "tiny-llama", "prompt": "' + b"a" * limit + b'"}'
    content = body if declared else (body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20))
    resp = http.post(COMPLETIONS, content=content, headers={"content-type": "application/json"})
    assert_openai_error(resp, 413, None, "request_too_large")
    assert_still_serving(http)


def assert_openai_error(resp: httpx.Response, status: int, param: str | None, code: str | None) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert (error["param"], error["code"]) == (param, code)


def assert_still_serving(http: httpx.Client) -> None:
    resp = http.post(COMPLETIONS, json={"model": TINY, "prompt": "ok", "max_tokens": 2, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2


# ---- prefix cache, cancellation, metrics ---------------------------------------------------

def test_repeated_long_prompt_hits_the_prefix_cache(client):
    prompt = f"{uuid.uuid4().hex} " + " ".join(f"step {i}: read the file, then edit it." for i in range(20))
    first = client.completions.create(model=TINY, prompt=prompt, temperature=0, max_tokens=16)
    second = client.completions.create(model=TINY, prompt=prompt, temperature=0, max_tokens=16)
    page_size = next(i.page_size for i in load_config(DEFAULT_CONFIG).instances if i.name == TINY_INSTANCE)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 500
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # the uuid makes the first page new
    assert second.usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens - page_size
    assert second.choices[0].text == first.choices[0].text


def test_the_hot_instance_publishes_the_correction_of_its_profile(client, server):
    client.chat.completions.create(model="smollm2", temperature=0, max_tokens=4,
                                   messages=[{"role": "user", "content": "Say hi."}])

    def corrections() -> dict:
        entry = server.telemetry().json()["instances"]["hot-0"]
        return entry["stats"]["cost_scale"]
    scale = wait_for(lambda: (s := corrections()) and {"smollm2/prefill", "smollm2/decode"} <= set(s) and s,
                     10, "hot-0's cost corrections in telemetry")
    assert all(0.1 <= v <= 10.0 for v in scale.values()), scale  # measured / profile-priced, clamped


def test_client_disconnect_cancels_the_call_and_frees_its_kv(client, server):
    stream = client.completions.create(model=TINY, prompt="tell me a long story", temperature=0,
                                       max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    wait_for(lambda: instance_gauge(server, "talaria_num_requests_running", TINY_INSTANCE) == 1, 5,
             "reported running")
    assert instance_gauge(server, "talaria_kv_pages_used", TINY_INSTANCE) > 0
    stream.close()
    wait_for(lambda: instance_gauge(server, "talaria_num_requests_running", TINY_INSTANCE) == 0
             and instance_gauge(server, "talaria_kv_pages_used", TINY_INSTANCE) == 0,
             CANCEL_DEADLINE_S, "idle with no KV pages in use after the disconnect")
    assert server.health().json()["instances"][TINY_INSTANCE]["in_flight"] == 0


def test_metrics_expose_latency_histograms_and_load_gauges(client, server):
    labels = frozenset({("model", "tiny-qwen3"), ("instance", TINY_INSTANCE)})
    histograms = ("talaria_ttft_seconds", "talaria_time_per_output_token_seconds", "talaria_e2e_latency_seconds")
    before = metric_samples(server)
    client.completions.create(model="tiny-qwen3", prompt="count", max_tokens=4, extra_body={"ignore_eos": True})
    after = metric_samples(server)
    for name in histograms:
        assert after[(name + "_count", labels)] == before.get((name + "_count", labels), 0) + 1
        assert after[(name + "_sum", labels)] > before.get((name + "_sum", labels), 0)
    assert after[("talaria_completion_tokens_total", labels)] == \
        before.get(("talaria_completion_tokens_total", labels), 0) + 4
    for instance in ("hot-0", TINY_INSTANCE):
        only = frozenset({("instance", instance)})
        assert after[("talaria_num_requests_waiting", only)] >= 0
        assert after[("talaria_num_requests_running", only)] >= 0
        assert after[("talaria_kv_pages_total", only)] > 0
        assert 0 <= after[("talaria_kv_usage_ratio", only)] <= 1


# ---- operator endpoints: telemetry and forced switches ----------------------------------------

def _cold_stats(server) -> dict:
    return server.telemetry().json()["instances"]["cold-0"]["stats"]


def test_admin_switch_answers_with_the_switch_record_and_telemetry_follows(server):
    stats = wait_for(lambda: _cold_stats(server), 10, "cold-0 telemetry")
    first, other = stats["models"]
    # telemetry may lag a switch other tests' traffic caused: open `first` explicitly, then switch away
    httpx.post(server.base_url + "/talaria/admin/switch", json={"instance": "cold-0", "model": first}, timeout=60)
    resp = httpx.post(server.base_url + "/talaria/admin/switch", json={"instance": "cold-0", "model": other},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    record = resp.json()["switch"]
    assert record["to_model"] == other and record["path"] in ("full_d2d", "partial", "h2d_only")
    assert len(record["ranks"]) == 2  # cold-0 is a TP=2 group: one record per rank
    assert list(record["ranks"][0]["phase_ms"]) == ["save_teardown", "open_weights", "kv_shell", "runtime",
                                                    "publish"]
    assert record["total_ms"] == max(sum(r["phase_ms"].values()) for r in record["ranks"])
    after = wait_for(lambda: (s := _cold_stats(server))["switches"] > stats["switches"] and s["active_model"] == other
                     and s, 10, "telemetry to show the switch")
    assert after["last_switch"]["to_model"] == other
    again = httpx.post(server.base_url + "/talaria/admin/switch", json={"instance": "cold-0", "model": other},
                       timeout=60)
    assert again.status_code == 200 and again.json()["switch"] is None  # already active: nothing to do


@pytest.mark.parametrize("body,status,code", [
    ({"instance": "nope", "model": "tiny-llama"}, 404, "instance_not_found"),
    ({"instance": "cold-0", "model": "smollm2"}, 400, "model_not_served"),
    ({"instance": "cold-0"}, 400, None),
])
def test_admin_switch_rejects_bad_requests(server, body, status, code):
    resp = httpx.post(server.base_url + "/talaria/admin/switch", json=body, timeout=10)
    assert resp.status_code == status
    assert resp.json()["error"]["code"] == code


def test_event_stream_carries_the_switch_with_its_phases(server):
    first, other = wait_for(lambda: _cold_stats(server), 10, "cold-0 telemetry")["models"]
    switch = server.base_url + "/talaria/admin/switch"
    httpx.post(switch, json={"instance": "cold-0", "model": first}, timeout=60)
    record = httpx.post(switch, json={"instance": "cold-0", "model": other}, timeout=60).json()["switch"]
    with httpx.stream("GET", server.base_url + "/talaria/events?since=0", timeout=10) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        seqs = []
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: "):])
            seqs.append(event["seq"])
            if event["kind"] == "switch" and event["total_ms"] == record["total_ms"]:
                break
    assert event["instance"] == "cold-0" and event["to_model"] == other and len(event["ranks"]) == 2
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_event_stream_rejects_a_bad_since(server):
    resp = httpx.get(server.base_url + "/talaria/events?since=abc", timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "since"
