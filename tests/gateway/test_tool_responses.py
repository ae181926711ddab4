"""The response shapes of parsed chat output, whole and streamed, against a scripted fake instance.

The fake answers with a fixed text (as byte tokens) and ends its turn, so the exact messages and
chunks are known: reasoning in `reasoning_content`, tool calls in `tool_calls` (streamed as index,
id, type and name first, then the arguments in pieces), `finish_reason` "tool_calls" for a turn
that called tools, and content null when there is nothing else to say.
"""

from __future__ import annotations

import dataclasses
import json

from starlette.testclient import TestClient

from talaria.config.schema import ModelConfig, ReasoningParser
from talaria.gateway.gateway import create_app
from tests.gateway.fakes import MODEL, FakeEchoGroup, FakeEchoSupervisor

TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
ANSWER = ('<think>\nThe user wants files.\n</think>\n\nLet me look.\n<tool_call>\n{"name": "ls", "arguments": '
          '{"path": "src", "all": true}}\n</tool_call>\n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>')


def client(script: str, reasoning: bool = True) -> TestClient:
    node = FakeEchoSupervisor([FakeEchoGroup("hot0", script=script)], max_position=4096)
    parser = ReasoningParser.THINK if reasoning else ReasoningParser.NONE
    node.config = dataclasses.replace(node.config, models=(ModelConfig(MODEL, "synthetic:", reasoning_parser=parser),))
    ids = iter(range(1000))
    return TestClient(create_app(node, new_id=lambda: f"{next(ids):032x}"), raise_server_exceptions=False)


def body(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "list the files"}], "tools": TOOLS,
            "max_tokens": 400, **extra}


def test_the_whole_response_has_reasoning_content_and_calls_apart():
    r = client(ANSWER).post("/v1/chat/completions", json=body())
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant", "content": "Let me look.\n", "reasoning_content": "\nThe user wants files.\n",
        "tool_calls": [
            {"id": "call_" + f"{1:032x}"[:24], "type": "function",
             "function": {"name": "ls", "arguments": '{"path": "src", "all": true}'}},
            {"id": "call_" + f"{2:032x}"[:24], "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}


def test_the_stream_says_the_same_in_order():
    with client(ANSWER).stream("POST", "/v1/chat/completions", json=body(stream=True)) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    assert reasoning == "\nThe user wants files.\n" and content == "Let me look.\n"
    first = [c for c in calls if "id" in c]
    assert [(c["index"], c["type"], c["function"]) for c in first] == [
        (0, "function", {"name": "ls", "arguments": ""}), (1, "function", {"name": "ls", "arguments": ""})]
    for index, arguments in ((0, '{"path": "src", "all": true}'), (1, "{}")):
        pieces = [c["function"]["arguments"] for c in calls if c["index"] == index and "id" not in c]
        assert "".join(pieces) == arguments
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # no piece of a call's JSON ever went out as content
    assert all("<tool_call>" not in d.get("content", "") and "{" not in d.get("content", "") for d in deltas)


def test_a_turn_with_only_calls_has_null_content_and_plain_text_is_untouched():
    only = client('<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>', reasoning=False)
    message = only.post("/v1/chat/completions", json=body()).json()["choices"][0]["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 1 and "reasoning_content" not in message
    plain = client("<think> is not special here", reasoning=False)
    choice = plain.post("/v1/chat/completions", json=body(tools=None)).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "<think> is not special here"}
    assert choice["finish_reason"] == "stop"


def test_tool_choice_none_parses_nothing():
    r = client(ANSWER, reasoning=False).post("/v1/chat/completions", json=body(tool_choice="none"))
    message = r.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": ANSWER}
