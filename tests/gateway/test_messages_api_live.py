"""Anthropic's Messages API through the real `anthropic` SDK against real `talaria up` nodes.

- SmolLM2 (the session's shared server): a forced tool gives a `tool_use` block whose input
  validates, with stop_reason "tool_use"; the SDK's stream helper puts the streamed message together
  equal to the whole one; a `tool_result` round trip is served; count_tokens equals the call's
  input tokens; errors arrive as the SDK's typed exceptions.
- A long-context synthetic model (byte tokenizer, 131,072 positions; its own node, with an API
  key): a request of a coding agent's real shape and size streams as a well-formed event stream,
  and a session whose first system line changes on every call still reads its previous call's
  prompt from the prefix cache.
- Claude Code 2.1's request shape on the same node (issue 37), sent through the SDK's beta client
  with its beta headers: a system turn inside the conversation, adaptive thinking with its display
  omitted, `output_config.effort`, a `clear_thinking` edit and a deferred tool loaded by a
  `tool_reference` stream well-formed, and count_tokens counts what usage bills; a 5-call session
  named only by the JSON `metadata.user_id` reads each previous call's prompt from the prefix
  cache and is one session to the router.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest

from tests.conftest import Server, served

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}  # this SDK has no temperature argument: Anthropic's default is 1
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The current weather in a city", "input_schema": CITY}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FIXTURE = Path(__file__).parent / "fixtures" / "agent_request.json"
CLAUDE_CODE = Path(__file__).parent / "fixtures" / "messages" / "claude-code-2.1.json"
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def smol(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def test_a_forced_tool_gives_a_tool_use_block_and_a_round_trip(smol):
    forced = {"type": "tool", "name": "get_weather"}
    m = smol.messages.create(model="smollm2", max_tokens=100, tools=TOOLS, tool_choice=forced, messages=ASK,
                             extra_body=GREEDY)
    assert m.stop_reason == "tool_use" and m.role == "assistant" and m.type == "message" and m.id.startswith("msg_")
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, CITY)
    with smol.messages.stream(model="smollm2", max_tokens=100, tools=TOOLS, tool_choice=forced, messages=ASK,
                              extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == m.stop_reason and streamed.stop_sequence is None
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [b.model_dump(exclude={"id"}) for b in m.content]
    history = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}]}]
    answer = smol.messages.create(model="smollm2", max_tokens=20, tools=TOOLS, messages=history, extra_body=GREEDY,
                                  thinking={"type": "enabled", "budget_tokens": 1024})  # SmolLM2 does not think: ignored
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"


def test_count_tokens_equals_the_input_tokens_of_the_same_request(smol):
    request = {"model": "smollm2", "system": f"Session {uuid.uuid4().hex}: answer briefly.", "tools": TOOLS,
               "messages": [{"role": "user", "content": "Name one French city."}]}
    counted = smol.messages.count_tokens(**request)
    m = smol.messages.create(**request, max_tokens=4, extra_body=GREEDY)
    assert counted.input_tokens == m.usage.input_tokens > 100  # the tools are rendered into the prompt
    assert m.usage.cache_read_input_tokens == 0  # a fresh prompt: everything was computed


def test_errors_are_the_sdks_typed_exceptions(smol):
    with pytest.raises(anthropic.NotFoundError) as missing:
        smol.messages.create(model="no-such-model", max_tokens=5, messages=ASK)
    assert missing.value.body["error"]["type"] == "not_found_error"
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                        "data": "iVBORw0KGgo="}}]}]
    with pytest.raises(anthropic.BadRequestError, match="image blocks are not supported"):
        smol.messages.create(model="smollm2", max_tokens=5, messages=image)
    with pytest.raises(anthropic.BadRequestError, match="tool_choice names function"):
        smol.messages.create(model="smollm2", max_tokens=5, messages=ASK, tools=TOOLS,
                             tool_choice={"type": "tool", "name": "nope"})


# ---- a long-context model on a node of its own ---------------------------------------------------

CONFIG = f'''
[server]
api_key = "{KEY}"

[[models]]
name = "long"
source = "synthetic:"
dtype = "float32"
seed = 4

[models.shape]
family = "llama"
hidden_size = 32
intermediate_size = 128
num_layers = 1
num_heads = 2
num_kv_heads = 1
vocab_size = 320
max_position = 131072

[[instances]]
name = "hot-0"
pool = "hot"
models = ["long"]
arena_bytes = "256MiB"
page_size = 16
max_batch_tokens = 8192
'''


@pytest.fixture(scope="module")
def long_node(tmp_path_factory) -> Server:
    with served(tmp_path_factory.mktemp("long"), CONFIG) as node:
        yield node


def test_an_agent_request_of_real_shape_and_size_streams_well_formed(long_node):
    """The fixture is a coding agent's request as sent (3 system blocks, the first the volatile billing
    line; 17 tools; cache_control; a session in metadata.user_id; stream), about 74 KB. max_tokens is
    lowered from its 32000: a random model would decode every one of them (the context left bounds
    it; tests/gateway/test_anthropic_protocol.py checks that)."""
    body = json.loads(FIXTURE.read_text())
    assert len(json.dumps(body)) > 70_000 and len(body["tools"]) == 17 and len(body["system"]) == 3
    body |= {"model": "long", "max_tokens": 48}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14",
               "content-type": "application/json"}
    with httpx.stream("POST", long_node.base_url + "/v1/messages?beta=true", json=body, headers=headers,
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    events = [(lines[i].removeprefix("event: "), json.loads(lines[i + 1].removeprefix("data: ")))
              for i in range(0, len(lines), 2)]
    assert all(lines[i].startswith("event: ") and lines[i + 1].startswith("data: ") for i in range(0, len(lines), 2))
    assert [kind for kind, _ in events[:2]] == ["message_start", "ping"]
    assert events[0][1]["message"]["usage"]["input_tokens"] > 70_000
    well_formed(events, 48)


def well_formed(events: list[tuple[str, dict]], max_tokens: int) -> dict:
    """Checks a Messages event stream's order and indices; returns its final usage. A `ping` may
    follow `message_start` (the SDK's stream drops it)."""
    assert all(kind == data["type"] for kind, data in events)
    if len(events) > 1 and events[1][0] == "ping":
        events = events[:1] + events[2:]
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"] and "ping" not in kinds
    start = events[0][1]["message"]
    assert start["role"] == "assistant" and start["content"] == []
    opened = []
    for kind, data in events[1:-2]:  # blocks open, take deltas at their own index, and close in order
        if kind == "content_block_start":
            assert data["index"] == len(opened)
            opened.append(data["content_block"]["type"])
        elif kind == "content_block_delta":
            assert data["index"] == len(opened) - 1
        else:
            assert kind == "content_block_stop" and data["index"] == len(opened) - 1
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    assert delta["usage"]["output_tokens"] <= max_tokens
    assert delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"] == start["usage"]["input_tokens"]
    return delta["usage"]


def test_a_session_reuses_its_prefix_though_its_first_system_line_changes(long_node):
    # a new session may be shed (429 + Retry-After) while the previous test's lease still reserves
    # its return: the client honours Retry-After, as agents' SDKs do by default
    client = anthropic.Anthropic(base_url=long_node.base_url, api_key=KEY, max_retries=2)
    session = f"user_ab12_account__session_{uuid.uuid4()}"
    instructions = "You are a coding agent. " + " ".join(f"Rule {i}: read before you edit." for i in range(60))
    messages: list[dict] = []
    totals, reads = [], []
    for turn in range(5):
        billing = f"x-anthropic-billing-header: cc_version=2.1.0; cch={uuid.uuid4().hex[:12]};"
        messages.append({"role": "user", "content": f"Step {turn}: list the files in folder {turn}."})
        m = client.messages.create(model="long", max_tokens=24, messages=messages, metadata={"user_id": session},
                                   system=[{"type": "text", "text": billing}, {"type": "text", "text": instructions}],
                                   extra_body=GREEDY)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        totals.append(m.usage.input_tokens + m.usage.cache_read_input_tokens)
        reads.append(m.usage.cache_read_input_tokens)
    for k in range(1, 5):
        assert reads[k] >= 0.9 * totals[k - 1], (reads, totals)


def test_the_key_may_come_as_x_api_key_or_bearer(long_node):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=long_node.base_url, api_key="wrong", max_retries=0).messages.create(
            model="long", max_tokens=2, messages=ASK)
    bearer = httpx.post(long_node.base_url + "/v1/messages/count_tokens", timeout=30,
                        headers={"authorization": f"Bearer {KEY}"}, json={"model": "long", "messages": ASK})
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0


# ---- Claude Code 2.1 (issue 37) -----------------------------------------------------------------

BETAS = ["claude-code-20250219", "interleaved-thinking-2025-05-14", "context-management-2025-06-27",
         "mid-conversation-tool-changes-2026-07-01", "thinking-token-count-2026-05-13",
         "advanced-tool-use-2025-11-20", "effort-2025-11-24"]
TODAY = {"thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "high"},
         "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}


def claude_code(node: Server) -> anthropic.Anthropic:
    """The SDK as Claude Code sets it up: its beta client adds `?beta=true` and the beta header."""
    return anthropic.Anthropic(base_url=node.base_url, api_key=KEY, max_retries=2,
                               default_headers={"x-app": "cli", "user-agent": "claude-cli/2.1.208 (external, cli)"})


def test_claude_code_2_1_s_request_streams_well_formed_and_counts_what_it_bills(long_node):
    body = json.loads(CLAUDE_CODE.read_text())["body"] | {"model": "long", "max_tokens": 24}
    assert [m["role"] for m in body["messages"]].count("system") == 2 and body["thinking"] == TODAY["thinking"]
    client = claude_code(long_node)
    stream = client.beta.messages.create(**body, betas=BETAS, extra_body=GREEDY)
    events = [(e.type, e.model_dump(mode="json", exclude_none=True)) for e in stream]
    usage = well_formed(events, 24)
    counted = client.beta.messages.count_tokens(**{k: v for k, v in body.items()
                                                   if k not in ("max_tokens", "stream", "metadata")}, betas=BETAS)
    assert counted.input_tokens == usage["input_tokens"] + usage["cache_read_input_tokens"] > 5000


def test_a_claude_code_session_named_by_its_json_user_id_is_one_session_reusing_its_prefix(long_node):
    """Five calls as Claude Code 2.1 makes them: a volatile billing line, a system turn after the
    first user turn, the session only in metadata.user_id's JSON. Calls 2-5 read at least 90% of the
    previous call's prompt from the prefix cache; the router routes all five as that one session."""
    telemetry = long_node.base_url + "/talaria/telemetry"
    sessions_before = httpx.get(telemetry, timeout=10).json()["router"]["sessions"]
    session = str(uuid.uuid4())
    user_id = json.dumps({"device_id": uuid.uuid4().hex * 2, "account_uuid": "", "session_id": session})
    instructions = "You are a coding agent. " + " ".join(f"Rule {i}: read before you edit." for i in range(60))
    messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                                         {"type": "text", "text": "Step 0: list the files."}]},
                            {"role": "system", "content": "<env>\nWorking directory: /home/dev/shop\n</env>"}]
    client, totals, reads, request_ids = claude_code(long_node), [], [], []
    for turn in range(5):
        billing = f"x-anthropic-billing-header: cc_version=2.1.208.9e4; cc_entrypoint=cli; cch={uuid.uuid4().hex[:12]};"
        raw = client.beta.messages.with_raw_response.create(
            model="long", max_tokens=24, messages=messages, metadata={"user_id": user_id}, betas=BETAS,
            system=[{"type": "text", "text": billing}, {"type": "text", "text": instructions}], **TODAY,
            extra_body=GREEDY)
        m = raw.parse()
        request_ids.append(raw.headers["x-request-id"])
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                     {"role": "user", "content": f"Step {turn + 1}: list the files in folder {turn + 1}."}]
        totals.append(m.usage.input_tokens + m.usage.cache_read_input_tokens)
        reads.append(m.usage.cache_read_input_tokens)
    assert all(reads[k] >= 0.9 * totals[k - 1] for k in range(1, 5)), (reads, totals)
    assert httpx.get(telemetry, timeout=10).json()["router"]["sessions"] == sessions_before + 1
    routed = {}
    with httpx.stream("GET", long_node.base_url + "/talaria/events?since=0", timeout=30) as r:
        for line in r.iter_lines():  # the replayed log holds every route event; stop at the last of ours
            event = json.loads(line.removeprefix("data: ")) if line.startswith("data: ") else {}
            if event.get("kind") == "route" and event["request"] in request_ids:
                routed[event["request"]] = event["session"]
            if len(routed) == len(request_ids):
                break
    assert set(routed.values()) == {session}
