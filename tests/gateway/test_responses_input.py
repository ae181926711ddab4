"""Responses API items in the chat shape (talaria/gateway/responses_input.py) and the store of
responses (talaria/gateway/response_store.py): each rule the module docstrings state."""

from __future__ import annotations

import pytest

from talaria.gateway.errors import APIError
from talaria.gateway.response_store import ResponseStore
from talaria.gateway.responses_input import conversation, offered_name, seal

CALL = {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"cmd": ["ls"]}'}


def test_a_turn_s_reasoning_message_and_calls_are_one_assistant_message():
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                              {"type": "input_text", "text": "b"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": seal("  exact\nthought ")},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
             CALL, {**CALL, "call_id": "call_2"},
             {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "b"}]},
             {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "s1"},
                                                             {"type": "summary_text", "text": "s2"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
             {"role": "user", "content": "next"}]
    calls = [{"id": c, "type": "function", "function": {"name": "shell", "arguments": '{"cmd": ["ls"]}'}}
             for c in ("call_1", "call_2")]
    assert conversation(items, {}) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "  exact\nthought ", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "call_2", "content": "b"},
        {"role": "assistant", "content": "Done.", "reasoning_content": "s1\n\ns2"},
        {"role": "user", "content": "next"}]


def test_a_reasoning_item_opens_a_new_turn_and_a_turn_may_only_reason():
    items = [{"role": "user", "content": "q"}, {"type": "reasoning", "summary": [], "content": [
        {"type": "reasoning_text", "text": "r1"}]}, {"type": "reasoning", "summary": []}]
    assert conversation(items, {})[1:] == [{"role": "assistant", "content": "", "reasoning_content": "r1"},
                                           {"role": "assistant", "content": "", "reasoning_content": ""}]


def test_another_server_s_encrypted_content_falls_back_to_the_summary():
    item = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}], "encrypted_content": "gAAAAABo"}
    assert conversation([item], {})[0]["reasoning_content"] == "s"


def test_namespaced_calls_are_read_under_their_offered_names():
    assert offered_name("crm", "lookup") == "crm__lookup" and offered_name("mcp__github__", "pr") == "mcp__github__pr"
    items = [{"role": "user", "content": "q"}, {**CALL, "name": "lookup", "namespace": "crm"}]
    (_, turn) = conversation(items, {"crm__lookup": ("crm", "lookup")})
    assert turn["tool_calls"][0]["function"]["name"] == "crm__lookup"


@pytest.mark.parametrize("item, where", [
    ({"type": "web_search_call", "id": "ws_1"}, "input[0].type"),
    ({"type": "item_reference", "id": "msg_1"}, "input[0].type"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}, "input[0].content[0]"),
    ({"role": "tool", "content": "x"}, "input[0].role"),
    ({"type": "function_call", "call_id": "c", "name": "f"}, "input[0].arguments"),
])
def test_what_talaria_cannot_read_is_a_400_naming_it(item, where):
    with pytest.raises(APIError) as e:
        conversation([item], {})
    assert e.value.status == 400 and e.value.param == where


def test_the_store_is_per_tenant_bounded_and_expires():
    now = [0.0]
    store = ResponseStore(lambda: now[0], ttl_s=10, per_tenant=2, max_items=5)
    item = ({"role": "user", "content": "x"},)
    store.put("a", "r1", item, (), {})
    store.put("a", "r2", item, (), {})
    with pytest.raises(APIError) as other:
        store.get("b", "r1")  # another tenant's response does not exist for it
    assert other.value.status == 404 and other.value.code == "previous_response_not_found"
    store.put("a", "r3", item, (), {})  # a full tenant drops its oldest
    with pytest.raises(APIError):
        store.get("a", "r1")
    assert store.get("a", "r3").items == item
    store.put("b", "r4", item * 4, (), {})  # 6 items held, 5 allowed: the oldest response of any tenant goes
    with pytest.raises(APIError):
        store.get("a", "r2")
    assert store.get("a", "r3").items == item
    now[0] = 10.5  # every one stored at t <= 0.5 has expired
    with pytest.raises(APIError):
        store.get("b", "r4")
