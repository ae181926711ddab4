"""The Messages API's turns in chat shape (talaria/gateway/anthropic_conversation.py) and what the
chat prompt makes of them (talaria/gateway/chat_prompt.py), on byte-level catalogs with the
templates that matter:
- a system turn inside `messages` is rendered where it stands; a template that takes one system
  message only (refusing, dropping or hoisting later ones) gets it as a user turn in place — never
  a 400, on either API — and a session's next prompt still extends its last;
- a `clear_thinking` edit's `keep` decides which earlier turns show their thinking; without one none
  do, and other edits change nothing;
- a deferred tool is not listed until the conversation loads it (tool_reference, tool_addition),
  and then shown there; its calls are parsed; `tool_removal` and `clear_at` do what they say;
- blocks Talaria cannot show are 400s that name them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from talaria.config.schema import ServerConfig
from talaria.gateway.anthropic_protocol import parse_messages
from talaria.gateway.chat_prompt import _system_turns_in_place
from talaria.gateway.errors import APIError
from talaria.gateway.openai_protocol import Endpoint, parse_request

from .fakes import MODEL, FakeEchoSupervisor, TemplateCatalog

FIXTURES = Path(__file__).parent / "fixtures" / "messages"
SERVER = ServerConfig()
GENERATION = "<|im_start|>assistant\n"
CHATML = ("{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}")
END = "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
# Qwen3.5's guard: a system message anywhere but first is an error.
REFUSING = ("{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
            "{{ raise_exception('System message must be at the beginning.') }}{%- endif %}" + CHATML + END)
# Drops every system message but a first one.
DROPPING = "{%- for m in messages %}{%- if m.role != 'system' or loop.first %}" + CHATML + "{%- endif %}" + END
# Collects every system message into one at the top (DeepSeek-V3's way).
HOISTING = ("{%- set ns = namespace(system='') %}{%- for m in messages %}{%- if m.role == 'system' %}"
            "{%- set ns.system = ns.system + m.content + '\\n' %}{%- endif %}{%- endfor %}"
            "{{ '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' }}"
            "{%- for m in messages %}{%- if m.role != 'system' %}" + CHATML + "{%- endif %}" + END)
# Renders an assistant turn's reasoning_content before its answer (Qwen3's way).
REASONING = ("{%- for m in messages %}{%- if m.role == 'assistant' and m.reasoning_content %}"
             "{{ '<|im_start|>assistant\\n<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' + (m.content or '') "
             "+ '<|im_end|>\\n' }}{%- else %}" + CHATML + "{%- endif %}" + END)

ENV = "<env>\nWorking directory: /home/dev/shop\n</env>"
CLAUDE_CODE = [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                            {"type": "text", "text": "plot weekly sales"}]},
               {"role": "system", "content": [{"type": "text", "text": ENV}]},
               {"role": "assistant", "content": "On it."},
               {"role": "user", "content": "thanks"}]


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def parsed(catalog, messages: list, **body):
    return parse_messages({"model": MODEL, "max_tokens": 10, "messages": messages, **body}, catalog, SERVER)


def text_of(catalog, request) -> str:
    return catalog.tokenizer(MODEL).decode(request.prompt_token_ids)


@pytest.fixture(scope="module")
def catalog():
    return FakeEchoSupervisor(max_position=16384)


def test_a_system_turn_is_rendered_where_it_stands(catalog):
    m = parsed(catalog, CLAUDE_CODE, system="You are a coding agent.")
    assert [x["role"] for x in m.messages] == ["system", "user", "system", "assistant", "user"]
    text = text_of(catalog, m)
    assert text.index("plot weekly sales") < text.index(f"<|im_start|>system\n{ENV}<|im_end|>") < text.index("On it.")
    assert _system_turns_in_place(catalog.tokenizer(MODEL))


@pytest.mark.parametrize("template", [REFUSING, DROPPING, HOISTING], ids=["refusing", "dropping", "hoisting"])
def test_a_one_system_template_gets_later_system_turns_as_user_turns_in_place(template):
    one = TemplateCatalog(template)
    assert not _system_turns_in_place(one.tokenizer(MODEL))
    text = text_of(one, parsed(one, CLAUDE_CODE, system="You are a coding agent."))
    assert text.startswith("<|im_start|>system\nYou are a coding agent.")
    assert text.index("plot weekly sales") < text.index(f"<|im_start|>user\n{ENV}<|im_end|>") < text.index("On it.")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "developer", "content": "Answer in French."}]  # a late developer message, on chat
    late = one.tokenizer(MODEL).decode(parse_request(Endpoint.CHAT, {"model": MODEL, "messages": chat}, one).prompt_token_ids)
    assert late.index("hi") < late.index("<|im_start|>user\nAnswer in French.")


@pytest.mark.parametrize("template", [None, REFUSING], ids=["in-place", "one-system"])
def test_each_call_of_a_claude_code_session_extends_the_last_prompt(catalog, template):
    """Call k of the 2.1 fixture's session sends its first turns; the last call adds a loaded
    deferred tool and a second system turn: each prompt, less its generation prompt, starts the next."""
    cat = catalog if template is None else TemplateCatalog(template, max_position=16384)
    body = fixture("claude-code-2.1.json")["body"] | {"model": MODEL, "max_tokens": 10}
    prompts = [text_of(cat, parse_messages(body | {"messages": body["messages"][:n]}, cat, SERVER))
               for n in (2, 4, 6, 7)]
    for before, after in zip(prompts, prompts[1:]):
        assert before.endswith(GENERATION) and after.startswith(before.removesuffix(GENERATION))
    assert "notebook_path" in prompts[1] and "notebook_path" not in prompts[0]  # the tool loaded in call 2


THOUGHTS = [{"role": "user", "content": "go"}]
for n in (1, 2, 3):
    THOUGHTS += [{"role": "assistant", "content": [{"type": "thinking", "thinking": f"T{n}", "signature": "s"},
                                                   {"type": "text", "text": f"A{n}"}]},
                 {"role": "user", "content": f"U{n}"}]


@pytest.mark.parametrize("edits, shown", [
    (None, []),
    ([{"type": "clear_thinking_20251015", "keep": "all"}], ["T1", "T2", "T3"]),
    ([{"type": "clear_thinking_20251015", "keep": {"type": "all"}}], ["T1", "T2", "T3"]),
    ([{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}}], ["T2", "T3"]),
    ([{"type": "clear_thinking_20251015"}], ["T3"]),  # Anthropic's default: the latest turn's
    ([{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}], []),
    ([{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": 1}}], []),  # ignored
])
def test_clear_thinking_keeps_the_thinking_of_the_turns_it_says(edits, shown):
    reasoning = TemplateCatalog(REASONING)
    body = {"context_management": {"edits": edits}} if edits is not None else {}
    m = parsed(reasoning, THOUGHTS, **body)
    assert [x["reasoning_content"] for x in m.messages if "reasoning_content" in x] == shown
    text = text_of(reasoning, m)
    assert [t for t in ("T1", "T2", "T3") if f"<think>\n{t}\n</think>" in text] == shown
    assert all(f"A{n}" in text and f"U{n}" in text for n in (1, 2, 3))


LS = {"name": "ls", "description": "list files", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
NB = {"name": "nb_edit", "description": "edit a notebook cell", "defer_loading": True,
      "input_schema": {"type": "object", "properties": {"cell": {"type": "integer"}}}}
SEARCH = [{"role": "user", "content": "edit the notebook"},
          {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {"path": "."}}]},
          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                        "content": [{"type": "text", "text": "found:"},
                                                    {"type": "tool_reference", "tool_name": "nb_edit"}]}]}]


def test_a_deferred_tool_is_shown_where_the_conversation_loads_it(catalog):
    before = text_of(catalog, parsed(catalog, SEARCH[:1], tools=[LS, NB]))
    assert '"name": "ls"' in before and "nb_edit" not in before  # listed: ls only
    m = parsed(catalog, SEARCH, tools=[LS, NB])
    text = text_of(catalog, m)
    definition = '<tools>\n{"type": "function", "function": {"name": "nb_edit", "parameters": {"type": "object", ' \
                 '"properties": {"cell": {"type": "integer"}}}, "description": "edit a notebook cell"}}\n</tools>'
    assert text.count("nb_edit") == 1 and text.index("found:") < text.index(definition)
    assert m.messages[-1] == {"role": "tool", "tool_call_id": "t1", "content": f"found:\n{definition}"}
    assert set(m.tool_schemas) == {"ls", "nb_edit"}  # the loaded tool's calls are parsed
    call = '<tool_call>\n{"name": "nb_edit", "arguments": {"cell": 3}}\n</tool_call>'
    assert m.parse_output(call).tool_calls == [["nb_edit", '{"cell": 3}']]
    only_deferred = text_of(catalog, parsed(catalog, SEARCH[:1], tools=[NB]))
    assert "<tool_call>" in only_deferred and "nb_edit" not in only_deferred  # the call format, no tool yet


def test_a_template_with_its_own_tool_list_never_lists_a_deferred_tool():
    from .test_chat_prompt import QWEN35_TEMPLATE

    qwen = TemplateCatalog(QWEN35_TEMPLATE)
    text = text_of(qwen, parsed(qwen, SEARCH, tools=[LS, NB]))
    tools_section = text[:text.index("edit the notebook")]
    assert '"name": "ls"' in tools_section and "nb_edit" not in tools_section
    assert text.index("found:") < text.index('"name": "nb_edit"')


def test_system_turns_add_and_remove_tools_and_clear_themselves(catalog):
    def system(*blocks, **extra):
        return {"role": "system", "content": list(blocks), **extra}
    add = {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "nb_edit"}}
    remove = {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "ls"}}
    turns = [SEARCH[0], system({"type": "text", "text": "Notebooks now."}, add, remove)]
    text = text_of(catalog, parsed(catalog, turns, tools=[LS, NB]))
    assert text.index("Notebooks now.") < text.index('"name": "nb_edit"') < text.index(
        "The tool ls is no longer available.")
    hint = system({"type": "text", "text": "Reply in French this turn."}, clear_at="next_user_message")
    shown = text_of(catalog, parsed(catalog, [SEARCH[0], hint]))
    gone = text_of(catalog, parsed(catalog, [SEARCH[0], hint, {"role": "assistant", "content": "Oui."},
                                             {"role": "user", "content": "next"}]))
    assert "Reply in French" in shown and "Reply in French" not in gone


@pytest.mark.parametrize("turn, match", [
    ({"role": "developer", "content": "x"}, r'messages\[1\].role must be "user", "assistant" or "system"'),
    ({"role": "assistant", "content": [{"type": "compaction", "content": "earlier: ..."}]},
     r"messages\[1\].content\[0\]: unknown content block type 'compaction'; an? assistant message takes text, "
     "tool_use, thinking, redacted_thinking blocks"),
    ({"role": "assistant", "content": [{"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}]},
     "server_tool_use blocks are not supported: they belong to server tools"),
    ({"role": "user", "content": [{"type": "thinking", "thinking": "x"}]},
     "a 'thinking' block is not supported in a user message"),
    ({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]},
     r"content\[0\].content\[0\]: image blocks are not supported"),
    ({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                   "content": [{"type": "tool_reference", "tool_name": "rm"}]}]},
     "names the tool 'rm', which is not among the request's tools"),
    ({"role": "system", "content": [{"type": "tool_addition", "tool": {"type": "mcp_tool_reference", "name": "x",
                                                                       "server_name": "s"}}]},
     "not 'mcp_tool_reference': Talaria has no MCP client"),
    ({"role": "system", "content": "x", "clear_at": "tomorrow"}, r'messages\[1\].clear_at must be'),
])
def test_blocks_it_cannot_show_are_refused_by_name(catalog, turn, match):
    with pytest.raises(APIError, match=match) as e:
        parsed(catalog, [{"role": "user", "content": "hi"}, turn], tools=[LS])
    assert e.value.status == 400
