"""Tool calls and structured output through the real `openai` SDK against real `talaria up` nodes.

- SmolLM2 (the session's shared server): a named tool_choice gives a call whose arguments validate
  against the tool's schema, with finish_reason "tool_calls"; the history with that call and the
  tool's result is served; a json_schema response_format gives output that validates.
- A float64 synthetic model (its own node: no near-ties, so greedy output is exactly reproducible):
  streaming and non-streaming give identical tool calls and content, forced or not.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from openai import OpenAI

from tests.conftest import Server, start_server

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "list_files", "description": "List the files of a folder",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string",
                                                          "maxLength": 30}}, "required": ["path"],
                                                          "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def smol(server: Server) -> OpenAI:
    return OpenAI(base_url=server.api, api_key="none", max_retries=0)


def test_smollm2_named_tool_call_round_trip(smol):
    r = smol.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, temperature=0, max_tokens=120,
                                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (tool_call,) = choice.message.tool_calls
    assert tool_call.type == "function" and tool_call.function.name == "get_weather" and tool_call.id
    jsonschema.validate(json.loads(tool_call.function.arguments), WEATHER)
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": tool_call.id, "content": json.dumps({"celsius": 18})}]
    answer = smol.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, temperature=0,
                                          max_tokens=30)
    assert isinstance(answer.choices[0].message.content, str) and answer.choices[0].finish_reason in ("stop", "length")


def test_smollm2_json_schema_response_validates(smol):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30},
                                               "in_europe": {"type": "boolean"},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 200}},
              "required": ["capital", "in_europe", "rank"], "additionalProperties": False}
    r = smol.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


# ---- a float64 model: streamed and whole responses agree exactly ----------------------------------

CONFIG = '''
[[models]]
name = "tiny64"
source = "synthetic:"
dtype = "float64"
seed = 3

[models.shape]
family = "llama"
hidden_size = 64
intermediate_size = 128
num_layers = 2
num_heads = 4
num_kv_heads = 2
vocab_size = 320
max_position = 4096

[[instances]]
name = "hot-0"
pool = "hot"
models = ["tiny64"]
arena_bytes = "64MiB"
page_size = 16
'''


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory) -> OpenAI:
    folder = tmp_path_factory.mktemp("tiny64")
    config = folder / "talaria.toml"
    config.write_text(CONFIG)
    node = start_server(Path(config), folder / "talaria.log")
    try:
        node.wait_healthy()
        yield OpenAI(base_url=node.api, api_key="none", max_retries=0)
    finally:
        node.stop()


@pytest.mark.parametrize(("choice", "parallel"), [
    ("required", False), ({"type": "function", "function": {"name": "list_files"}}, True),
    ("required", True),  # random weights rarely stop calling: this one ends at max_tokens, mid-call
    ("auto", True),  # random weights write no call: all content
])
def test_streamed_and_whole_responses_carry_the_same_calls_and_content(tiny64, choice, parallel):
    request = {"model": "tiny64", "messages": ASK, "tools": TOOLS, "tool_choice": choice, "temperature": 0,
               "max_tokens": 300, "parallel_tool_calls": parallel}
    whole = tiny64.chat.completions.create(**request).choices[0]
    content, streamed_calls, finish = assembled(tiny64.chat.completions.create(**request, stream=True))
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
    assert streamed_calls == calls
    assert content == whole.message.content
    assert finish == whole.finish_reason
    if choice != "auto" and whole.finish_reason != "length":  # forced: calls the schemas accept, then the end
        assert calls and whole.finish_reason == "tool_calls" and whole.message.content is None
        for name, arguments in calls:
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
            jsonschema.validate(json.loads(arguments), schema)


def assembled(chunks) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) as a client puts a stream together: ids, types and
    names arrive once per call index, arguments in pieces."""
    content, calls, finish = None, {}, None
    for chunk in chunks:
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.content:
            content = (content or "") + delta.content
        for piece in delta.tool_calls or ():
            if piece.id is not None:
                assert piece.index not in calls and piece.function.name and piece.type == "function"
                calls[piece.index] = [piece.function.name, piece.function.arguments or ""]
            elif piece.function.arguments:
                calls[piece.index][1] += piece.function.arguments
        finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish
