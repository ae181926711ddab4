"""`/v1/responses` through the real `openai` SDK against the real gateway over loopback, with a
scripted fake instance (tests/gateway/fakes.py), so the exact items, events and prompts are known:
whole and streamed responses hold the same items; the stream is well formed, every event valid as
the SDK's type (tests/gateway/responses_events.py); an instance failure mid-stream is an `error`
event then `response.failed`; `previous_response_id` renders the prompt that sending every item back
renders, per tenant; hosted tools stay out of the prompt; the session precedence; truncation."""

from __future__ import annotations

import dataclasses
import json
from contextlib import contextmanager

import openai
import pytest

from talaria.config.schema import ApiKeyConfig, ModelConfig, ReasoningParser, ServerConfig
from talaria.gateway.gateway import create_app
from tests.gateway.fakes import MODEL, FakeEchoGroup, FakeEchoSupervisor, serve_app
from tests.gateway.responses_events import check_well_formed, stream_events

SHELL = {"type": "function", "name": "shell", "description": "Run a command",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
CRM = {"type": "namespace", "name": "crm", "description": "The CRM", "tools": [{"type": "function", "name": "lookup"}]}
HOSTED = [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]}, {"type": "code_interpreter",
                                                                                         "container": {"type": "auto"}}]
ANSWER = ('<think>\nThe user wants files.\n</think>\n\nLet me look.\n<tool_call>\n{"name": "shell", "arguments": '
          '{"cmd": "ls"}}\n</tool_call>\n<tool_call>\n{"name": "crm__lookup", "arguments": {}}\n</tool_call>')
ASK = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "list the files"}]


@contextmanager
def node(script: str, reasoning: bool = True, max_position: int = 8192, **server):
    """An SDK client on the real gateway over a scripted fake instance; yields (client, group)."""
    group = FakeEchoGroup("hot0", script=script)
    keys = server.pop("api_keys", ())
    sup = FakeEchoSupervisor([group], max_position=max_position, server=ServerConfig(api_keys=keys, **server))
    parser = ReasoningParser.THINK if reasoning else ReasoningParser.NONE
    sup.config = dataclasses.replace(sup.config, models=(ModelConfig(MODEL, "synthetic:", reasoning_parser=parser),))
    with serve_app(create_app(sup)) as url:
        key = keys[0].key if keys else "unused"
        yield openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0), group


def prompt(group: FakeEchoGroup, k: int = -1) -> str:
    return bytes(t for t in group.calls[k].prompt_token_ids if t < 256).decode()


def test_whole_and_streamed_responses_hold_the_same_items_and_events_are_in_order():
    with node(ANSWER) as (client, _):
        request = {"model": MODEL, "input": ASK, "tools": [SHELL, CRM, *HOSTED], "reasoning": {"summary": "auto"},
                   "include": ["reasoning.encrypted_content"], "max_output_tokens": 500}
        whole = client.responses.create(**request)
        events = stream_events(client, **request)
    assert whole.status == "completed" and whole.id.startswith("resp_") and whole.tools[2].type == "web_search"
    assert [o.type for o in whole.output] == ["reasoning", "message", "function_call", "function_call"]
    reasoning, message, shell, lookup = whole.output
    assert reasoning.summary[0].text == "\nThe user wants files.\n" and reasoning.encrypted_content
    assert message.content[0].text == "Let me look.\n" == whole.output_text
    assert (shell.name, json.loads(shell.arguments), shell.namespace) == ("shell", {"cmd": "ls"}, None)
    assert (lookup.name, lookup.namespace, lookup.call_id.startswith("call_")) == ("lookup", "crm", True)
    assert whole.usage.output_tokens_details.reasoning_tokens == len("<think>\nThe user wants files.\n</think>") - 15
    streamed = check_well_formed(events)
    assert events[-1].type == "response.completed"
    strip = {"id", "call_id", "encrypted_content"}
    assert [o.model_dump(exclude=strip) for o in streamed.output] == [o.model_dump(exclude=strip) for o in whole.output]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta") == \
        reasoning.summary[0].text


def test_reasoning_without_a_summary_carries_no_text_and_a_cut_answer_is_incomplete():
    with node(ANSWER) as (client, _):
        r = client.responses.create(model=MODEL, input="hi", max_output_tokens=10)
        events = [e.type for e in client.responses.create(model=MODEL, input="hi", max_output_tokens=10, stream=True)]
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "reasoning" and r.output[0].summary == [] and r.output[0].encrypted_content is None
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 10
    assert events[-1] == "response.incomplete" and "response.reasoning_summary_text.delta" not in events


def test_an_instance_failure_mid_stream_is_an_error_event_then_response_failed():
    with node("x" * 50, reasoning=False) as (client, group):
        group.fail_after = 5
        events = stream_events(client, model=MODEL, input="hi")
    failed = check_well_formed(events)
    assert [e.type for e in events[-2:]] == ["error", "response.failed"] and failed.output[0].type == "message"
    assert events[-2].code == "instance_failed" and events[-1].response.error.code == "server_error"
    assert events[-1].response.status == "failed"


def test_previous_response_id_renders_what_sending_the_items_back_renders_per_tenant():
    keys = (ApiKeyConfig("key-a", "a"), ApiKeyConfig("key-b", "b"))
    with node(ANSWER, api_keys=keys) as (client, group):
        first = client.responses.create(model=MODEL, input=ASK, tools=[SHELL, CRM], instructions="Old rules.",
                                        include=["reasoning.encrypted_content"])
        results = [{"type": "function_call_output", "call_id": c.call_id, "output": "a.txt"} for c in first.output[2:]]
        client.responses.create(model=MODEL, previous_response_id=first.id, input=results, tools=[SHELL, CRM],
                                instructions="New rules.")
        chained = prompt(group)
        resent = [*ASK, *[o.model_dump(exclude_none=True) for o in first.output], *results]
        client.responses.create(model=MODEL, input=resent, tools=[SHELL, CRM], instructions="New rules.", store=False)
        assert prompt(group) == chained and "Old rules." not in chained and "New rules." in chained
        with pytest.raises(openai.NotFoundError) as other:  # tenant b cannot continue tenant a's response
            client.with_options(api_key="key-b").responses.create(model=MODEL, input="x",
                                                                   previous_response_id=first.id)
        with pytest.raises(openai.NotFoundError):  # store: false was not kept
            client.responses.create(model=MODEL, input="x", previous_response_id=group.calls[-1].request_id)
    assert other.value.body["code"] == "previous_response_not_found" and other.value.body["param"] == \
        "previous_response_id"


def test_hosted_tools_stay_out_of_the_prompt_and_the_session_precedence():
    with node("ok", reasoning=False) as (client, group):
        client.responses.create(model=MODEL, input="hi", tools=[SHELL, *HOSTED], prompt_cache_key="key-session",
                                extra_headers={"session-id": "header-session", "x-session-id": "x"})
        client.responses.create(model=MODEL, input="hi", tools=[SHELL],
                                extra_headers={"session-id": "header-session", "x-session-id": "x"})
        assert prompt(group, 0) == prompt(group, 1) and "web_search" not in prompt(group, 0)
        client.responses.create(model=MODEL, input="hi", extra_headers={"x-session-id": "x"})
    assert [c.session_id for c in group.calls] == ["key-session", "header-session", "x"]


def test_truncation_auto_drops_the_oldest_turns_and_disabled_refuses():
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "x" * 100} for i in range(9)]
    with node("ok", reasoning=False, max_position=500) as (client, group):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input=turns)
        r = client.responses.create(model=MODEL, input=turns, truncation="auto", instructions="Rules.")
        kept = prompt(group)
    assert refused.value.body["code"] == "context_length_exceeded" and r.status == "completed"
    assert kept.startswith("<|im_start|>system\nRules.") and "turn 8" in kept and "turn 0 " not in kept


@pytest.mark.parametrize("field, value, param", [
    ("tools", [{"type": "custom", "name": "apply_patch"}], "tools[0]"),
    ("tool_choice", {"type": "web_search"}, "tool_choice"),
    ("tool_choice", {"type": "function", "name": "nope"}, "tool_choice"),
    ("text", {"format": {"type": "json_schema", "name": "x"}}, "text.format.schema"),
    ("reasoning", {"effort": "extreme"}, "reasoning.effort"),
    ("background", True, "background"),
    ("input", [{"type": "computer_call_output", "call_id": "c"}], "input[0].type"),
])
def test_refusals_are_400s_naming_the_field(field, value, param):
    with node("ok", reasoning=False) as (client, _):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**{"model": MODEL, "input": "hi", "tools": [SHELL], field: value})
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
