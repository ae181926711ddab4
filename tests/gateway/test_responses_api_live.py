"""OpenAI's Responses API through the real `openai` SDK against real `talaria up` nodes (issue 32).

- SmolLM2 (the session's shared server): a forced function gives a `function_call` whose arguments
  validate; `responses.stream` puts together the response a whole call returns; a
  `function_call_output` round trip is served; a `text.format` JSON schema is followed; errors
  arrive as the SDK's typed exceptions.
- A long-context synthetic model with a reasoning template (its generation prompt opens `<think>`,
  as Qwen3.5's does; byte tokenizer, 131,072 positions; its own node, with an API key): a request of
  OpenAI's coding agent's real shape and size (a fixture) streams as a well-formed event sequence,
  every event read off the wire and validated as the SDK's type (tests/gateway/responses_events.py):
  forced to call one of its functions, it ends in `response.completed` with the call; with an output
  limit, in `response.incomplete`. A 5-call `store: false` session that sends back every item it
  got (reasoning included) reads at least 90% of each previous prompt from the prefix cache, and so
  does one that continues by `previous_response_id`.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import jsonschema
import openai
import pytest

from talaria.config.schema import SyntheticShape
from talaria.models.synthetic import write_synthetic
from tests.conftest import Server, served
from tests.gateway.responses_events import check_well_formed, stream_events

pytestmark = pytest.mark.slow

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": CITY, "strict": True}
ASK = "What is the weather in Paris?"
FIXTURE = Path(__file__).parent / "fixtures" / "responses" / "codex.json"
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def smol(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)


def test_a_forced_function_gives_a_call_the_stream_reassembles_and_a_round_trip(smol):
    forced = {"type": "function", "name": "get_weather"}
    r = smol.responses.create(model="smollm2", input=ASK, tools=[WEATHER], tool_choice=forced, temperature=0,
                              max_output_tokens=100)
    assert r.status == "completed" and r.id.startswith("resp_") and r.object == "response"
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), CITY)
    with smol.responses.stream(model="smollm2", input=ASK, tools=[WEATHER], tool_choice=forced, temperature=0,
                               max_output_tokens=100) as stream:
        streamed = stream.get_final_response()
    strip = {"id", "call_id", "parsed_arguments"}  # the helper parses a strict function's arguments
    assert [o.model_dump(exclude=strip) for o in streamed.output] == [o.model_dump(exclude=strip) for o in r.output]
    assert streamed.usage.input_tokens == r.usage.input_tokens
    history = [{"role": "user", "content": ASK}, *[o.model_dump(exclude_none=True) for o in r.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}]
    answer = smol.responses.with_raw_response.create(model="smollm2", input=history, tools=[WEATHER],
                                                     temperature=0, max_output_tokens=20)
    assert answer.status_code == 200
    assert answer.parse().status in ("completed", "incomplete") and answer.parse().output[0].type == "message"


def test_a_json_schema_format_is_followed(smol):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    r = smol.responses.create(model="smollm2", input="Name a city in France as JSON.", text={"format": fmt},
                              temperature=0, max_output_tokens=60)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), CITY)


def test_errors_are_the_sdks_typed_exceptions(smol):
    with pytest.raises(openai.NotFoundError) as missing:
        smol.responses.create(model="no-such-model", input=ASK)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="input_image parts are not supported"):
        smol.responses.create(model="smollm2", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}])
    with pytest.raises(openai.NotFoundError) as gone:
        smol.responses.create(model="smollm2", input=ASK, previous_response_id="resp_never")
    assert gone.value.code == "previous_response_not_found" and gone.value.param == "previous_response_id"


# ---- a long-context reasoning model on a node of its own ------------------------------------------

REASONING_TEMPLATE = (  # Qwen3.5's shape, reduced: every assistant turn shows its reasoning
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + (m.get('reasoning_content') or '') + '\\n</think>\\n\\n'"
    " + (m['content'] or '') + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
SHAPE = SyntheticShape(hidden_size=32, intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=1,
                       vocab_size=320, max_position=131072)


def thinking_model(folder: Path) -> Path:
    """A synthetic model directory whose chat template reasons first (its generation prompt opens <think>)."""
    write_synthetic(SHAPE, 5, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": REASONING_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def thinking_node(tmp_path_factory) -> Server:
    model = thinking_model(tmp_path_factory.mktemp("thinker"))
    config = f'''
[server]
api_key = "{KEY}"

[[models]]
name = "thinker"
source = "{model}"
dtype = "float32"

[[instances]]
name = "hot-0"
pool = "hot"
models = ["thinker"]
arena_bytes = "256MiB"
page_size = 16
max_batch_tokens = 8192
'''
    with served(tmp_path_factory.mktemp("thinking-node"), config) as node:
        yield node


def client(node: Server) -> openai.OpenAI:
    # a new session may be shed (429 + Retry-After) while an earlier test's lease still reserves its
    # return: the client honours Retry-After, as agents' SDKs do by default
    return openai.OpenAI(base_url=node.api, api_key=KEY, max_retries=2)


def codex_request() -> tuple[dict, dict]:
    """The fixture: OpenAI's coding agent's request as sent (developer and user messages, earlier calls,
    their outputs and reasoning items; 7 functions, a namespace of 2, web_search; store false;
    stream), about 40 KB, as (the SDK's keyword arguments, its headers)."""
    fixture = json.loads(FIXTURE.read_text())
    body, headers = fixture["body"], fixture["headers"]
    kinds = [t["type"] for t in body["tools"]]
    assert len(json.dumps(body)) > 40_000 and kinds.count("function") == 7 and "namespace" in kinds
    assert {"reasoning", "function_call", "function_call_output"} <= {i.get("type") for i in body["input"]}
    assert body["stream"] is True and body["tool_choice"] == "auto" and "max_output_tokens" not in body
    rest = {k: v for k, v in body.items() if k not in ("model", "input", "stream")}  # client_metadata too
    return {"model": "thinker", "input": body["input"], "extra_headers": headers, "extra_body": rest}, body


def test_the_coding_agent_s_request_forced_to_call_a_function_streams_to_response_completed(thinking_node):
    """The fixture with `tool_choice` forcing one of the functions it sends (its namespace's
    `get_pull_request`), and no max_output_tokens, as the agent sends none. That is how the
    generation ends on a random model: constrained decoding writes the call in the model's format from
    the first token (a forced call never starts inside the reasoning the generation prompt opened),
    and once the call is whole the grammar allows only the end of the turn. So the stream ends in
    `response.completed`, its one item a `function_call` whose arguments arrived as deltas.

    `seed` (Talaria's extension) makes the sample the same on every run: at the agent's temperature
    (1, it sends none) the random model's strings are of any length (98 to 1,632 tokens in six
    unseeded tries, seconds to minutes here); seed 0 wrote `{"repo": "", "number": 0}`, 107 tokens."""
    request, body = codex_request()
    forced = {"type": "function", "name": "get_pull_request", "namespace": "mcp__github__"}
    request["extra_body"] |= {"tool_choice": forced, "seed": 0}
    events = stream_events(client(thinking_node), **request)  # every event validated as the SDK's type
    final = check_well_formed(events)
    assert events[-1].type == "response.completed" and final.status == "completed"
    assert final.incomplete_details is None and final.error is None and final.tool_choice.name == "get_pull_request"
    (call,) = final.output
    assert (call.type, call.namespace, call.name, call.status) == \
        ("function_call", "mcp__github__", "get_pull_request", "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    (github,) = [t for t in body["tools"] if t["type"] == "namespace"]
    (schema,) = [f["parameters"] for f in github["tools"] if f["name"] == "get_pull_request"]
    jsonschema.validate(json.loads(call.arguments), schema)
    assert sum(e.type == "response.function_call_arguments.delta" for e in events) > 1  # streamed as generated
    usage = final.usage
    assert usage.input_tokens > 35_000 and 0 < usage.output_tokens < 4096  # ended by itself, not by a limit
    assert usage.output_tokens_details.reasoning_tokens == 0
    with client(thinking_node).responses.stream(**request) as sdk:  # the SDK's own reader, the same sample
        assembled = sdk.get_final_response()
    strip = {"id", "call_id", "parsed_arguments"}  # the helper's items carry parsed_arguments
    assert [o.model_dump(exclude=strip) for o in assembled.output] == [o.model_dump(exclude=strip) for o in final.output]
    assert assembled.status == "completed" and assembled.usage.input_tokens_details.cached_tokens > 35_000


def test_the_coding_agent_s_request_cut_by_max_output_tokens_streams_to_response_incomplete(thinking_node):
    """The fixture with max_output_tokens added: with tool_choice "auto" a random model reasons (the
    generation prompt opened <think>) and never closes it, so the output limit ends the stream, in
    `response.incomplete` with `incomplete_details` saying why."""
    request, _ = codex_request()
    request["extra_body"] |= {"max_output_tokens": 48}
    events = stream_events(client(thinking_node), **request)
    final = check_well_formed(events)
    assert events[-1].type == "response.incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.input_tokens > 35_000 and final.usage.output_tokens == 48
    (reasoning,) = final.output  # all 48 tokens are reasoning
    assert reasoning.type == "reasoning" and reasoning.status == "incomplete"
    assert reasoning.encrypted_content and reasoning.summary[0].text  # include and summary "auto" honoured
    assert final.usage.output_tokens_details.reasoning_tokens == 48
    assert sum(e.type == "response.reasoning_summary_text.delta" for e in events) > 1


def session_reads(node: Server, chained: bool) -> tuple[list[int], list[int]]:
    """Five calls of one agent session; (input tokens, cached tokens) per call. `chained`: by
    previous_response_id with store true, else every item sent back with store false."""
    instructions = "You are a coding agent. " + " ".join(f"Rule {i}: read before you edit." for i in range(60))
    items: list[dict] = []
    previous, totals, cached = None, [], []
    session = str(uuid.uuid4())
    for turn in range(5):
        new = [{"role": "user", "content": f"Step {turn}: list the files in folder {turn}."}]
        r = client(node).responses.create(
            model="thinker", instructions=instructions, input=new if chained else items + new, max_output_tokens=24,
            temperature=0, reasoning={"summary": "auto"}, include=["reasoning.encrypted_content"],
            store=chained, previous_response_id=previous if chained else openai.omit,
            extra_headers={"session-id": session})
        assert r.output[0].type == "reasoning"
        items += new + [o.model_dump(exclude_none=True) for o in r.output]
        previous = r.id
        totals.append(r.usage.input_tokens)
        cached.append(r.usage.input_tokens_details.cached_tokens)
    return totals, cached


@pytest.mark.parametrize("chained", [False, True], ids=["items-sent-back", "previous-response-id"])
def test_a_session_reads_each_previous_prompt_from_the_prefix_cache(thinking_node, chained):
    totals, cached = session_reads(thinking_node, chained)
    print(f"input tokens {totals}, cached {cached}")
    assert all(cached[k] >= 0.9 * totals[k - 1] for k in range(1, 5)), (cached, totals)


def test_the_key_is_required(thinking_node):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=thinking_node.api, api_key="wrong", max_retries=0).responses.create(
            model="thinker", input="hi", max_output_tokens=2)
    r = client(thinking_node).responses.with_raw_response.create(model="thinker", input="hi", max_output_tokens=2)
    assert r.status_code == 200 and r.headers["x-request-id"] == r.parse().id and r.parse().usage.output_tokens == 2
