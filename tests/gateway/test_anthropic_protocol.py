"""The Messages API without a model: request conversion and validation (parse_messages) and the
response shapes (MessageFormat), on the fake byte-level catalog. The live SDK tests are in
test_messages_api_live.py."""

from __future__ import annotations

import json

import pytest

from talaria.config.schema import ServerConfig, ToolParser
from talaria.contracts.call import Usage
from talaria.gateway.anthropic_protocol import parse_messages
from talaria.gateway.anthropic_responses import MessageFormat, error_body
from talaria.gateway.errors import APIError
from talaria.gateway.openai_protocol import Endpoint, parse_request
from talaria.gateway.output_parser import OutputParser, parse

from .fakes import MODEL, FakeEchoSupervisor, TemplateCatalog
from .test_anthropic_conversation import REASONING
from .test_chat_prompt import QWEN35_TEMPLATE

SERVER = ServerConfig()
ASK = [{"role": "user", "content": "list the files"}]
TOOLS = [{"name": "ls", "description": "list files", "input_schema": {"type": "object"},
          "cache_control": {"type": "ephemeral"}}]
BILLING = "x-anthropic-billing-header: cc_version=2.1.0; cch=0a1b2c3d;"


@pytest.fixture(scope="module")
def catalog():
    return FakeEchoSupervisor(max_position=4096)


def messages(catalog, header_session: str | None = None, server: ServerConfig = SERVER, **body):
    return parse_messages({"model": MODEL, "max_tokens": 10, "messages": ASK, **body}, catalog, server, header_session)


def text_of(catalog, parsed) -> str:
    return catalog.tokenizer(MODEL).decode(parsed.prompt_token_ids)


def test_a_conversation_makes_the_prompt_its_chat_completions_twin_makes(catalog):
    """Blocks, cache_control, tool_use and tool_result (is_error, block content), thinking blocks of
    earlier turns: the same prompt as the same conversation sent to /v1/chat/completions."""
    history = [
        {"role": "user", "content": [{"type": "text", "text": "list the files", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "the user wants ls", "signature": "sig"},
            {"type": "text", "text": "Listing."},
            {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"path": "."}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a.py"}]},
            {"type": "text", "text": "and the hidden ones?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "ls", "input": {"all": True}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "denied",
                                      "is_error": True}]},
    ]
    system = [{"type": "text", "text": "You list files."}, {"type": "text", "text": "Be brief."}]
    m = messages(catalog, system=system, messages=history, tools=TOOLS)
    chat = [
        {"role": "system", "content": "You list files.\n\nBe brief."},
        {"role": "user", "content": "list the files"},
        {"role": "assistant", "content": "Listing.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.py"},
        {"role": "user", "content": "and the hidden ones?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_2", "type": "function", "function": {"name": "ls", "arguments": '{"all": true}'}}]},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: denied"},
    ]
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"},
                                               "description": "list files"}}]
    c = parse_request(Endpoint.CHAT, {"model": MODEL, "max_tokens": 10, "messages": chat, "tools": tools}, catalog)
    assert m.prompt_token_ids == c.prompt_token_ids and m.messages == chat
    assert m.endpoint is Endpoint.MESSAGES and m.tool_format is ToolParser.HERMES and not m.stream
    assert "<tool_response>\nError: denied\n</tool_response>" in text_of(catalog, m)


def test_the_billing_line_is_dropped_unless_switched_off(catalog):
    system = [{"type": "text", "text": BILLING}, {"type": "text", "text": "You are a coding agent."}]
    kept_off = messages(catalog, system=system)
    other_call = messages(catalog, system=[{"type": "text", "text": BILLING.replace("0a1b", "9f8e")}, system[1]])
    assert kept_off.prompt_token_ids == other_call.prompt_token_ids  # call k+1 reuses call k's prefix
    assert "billing" not in text_of(catalog, kept_off) and "You are a coding agent." in text_of(catalog, kept_off)
    inline = messages(catalog, system=BILLING + "\nYou are a coding agent.")  # one string, first line
    assert inline.prompt_token_ids == kept_off.prompt_token_ids
    kept = messages(catalog, server=ServerConfig(strip_billing_header=False), system=system)
    assert BILLING in text_of(catalog, kept)


def test_max_tokens_is_required_and_bounded_by_the_context_left(catalog):
    with pytest.raises(APIError, match="max_tokens: field required"):
        parse_messages({"model": MODEL, "messages": ASK}, catalog, SERVER)
    counted = parse_messages({"model": MODEL, "messages": ASK}, catalog, SERVER, count_only=True)
    room = 4096 - len(counted.prompt_token_ids)
    assert messages(catalog, max_tokens=32000).sampling.max_tokens == room  # an agent's default
    assert messages(catalog, max_tokens=7).sampling.max_tokens == 7
    too_long = {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": "x" * 5000}]}
    with pytest.raises(APIError, match="prompt is too long") as e:
        parse_messages(too_long, catalog, SERVER)
    assert e.value.status == 400
    assert len(parse_messages(too_long, catalog, SERVER, count_only=True).prompt_token_ids) > 5000  # counted


def test_the_session_comes_from_the_header_then_metadata(catalog):
    user = {"user_id": "user_4f2a_account_9c1d_session_0e6b6a57-1f2c-4d8e-9a3b-1c2d3e4f5a6b"}
    assert messages(catalog, metadata=user).session_id == "0e6b6a57-1f2c-4d8e-9a3b-1c2d3e4f5a6b"
    assert messages(catalog, "from-header", metadata=user).session_id == "from-header"
    assert messages(catalog, metadata={"user_id": "plain-user"}).session_id is None  # inferred later
    assert messages(catalog).session_id is None
    # the header does not let a malformed metadata through, and a header too long is refused as such
    for bad in ("x", {"user_id": 5}):
        with pytest.raises(APIError, match="metadata"):
            messages(catalog, "from-header", metadata=bad)
    with pytest.raises(APIError, match="at most 256") as e:
        messages(catalog, "h" * 257, metadata=user)
    assert e.value.param == "X-Session-Id"


def test_claude_code_2_1_s_json_user_id_names_the_session(catalog):
    def user_id(**fields) -> dict:
        return {"user_id": json.dumps(fields)}
    claude = user_id(device_id="8f3c2a", account_uuid="", session_id="d4c3b2a1-6f5e-4d7c-8b9a-0e1f2a3b4c5d")
    assert messages(catalog, metadata=claude).session_id == "d4c3b2a1-6f5e-4d7c-8b9a-0e1f2a3b4c5d"
    assert messages(catalog, "from-header", metadata=claude).session_id == "from-header"
    assert messages(catalog, metadata=user_id(device_id="8f3c2a")).session_id is None  # no session in it
    assert messages(catalog, metadata=user_id(session_id="")).session_id is None
    suffix_in_json = user_id(device_id="x_session_wrong", session_id="right")  # the JSON form wins over the regex
    assert messages(catalog, metadata=suffix_in_json).session_id == "right"
    assert messages(catalog, metadata={"user_id": "{not json_session_abc"}).session_id == "abc"
    with pytest.raises(APIError, match="the session id must be at most 256 characters"):
        messages(catalog, metadata=user_id(session_id="s" * 300))


def test_sampling_stops_and_thinking(catalog):
    m = messages(catalog, temperature=0, top_p=0.5, top_k=40, stop_sequences=["\n\nHuman:", "END", "END"],
                 stream=True, thinking={"type": "enabled", "budget_tokens": 1024})
    s = m.sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.0, 0.5, 40) and m.stream
    assert m.stop == ("\n\nHuman:", "END") and not m.reasoning  # no reasoning model: thinking is ignored
    assert messages(catalog, thinking={"type": "disabled"}).sampling.temperature == 1.0  # Anthropic's default


@pytest.mark.parametrize("opens", [True, False], ids=["prompt-opens-think", "model-opens-think"])
def test_thinking_disabled_makes_a_reasoning_model_answer_with_its_prefix_unchanged(opens):
    """Qwen3.5's generation prompt opens <think>; Qwen3's (REASONING) leaves it to the model. `disabled` ends
    the prompt with an empty reasoning section either way, and nothing before it changes."""
    qwen = TemplateCatalog(QWEN35_TEMPLATE if opens else REASONING)
    on = [messages(qwen, thinking=t) for t in ({"type": "adaptive"}, {"type": "enabled", "budget_tokens": 2048}, None)]
    off = messages(qwen, thinking={"type": "disabled"})
    assert len({m.prompt_token_ids for m in on}) == 1 and all(m.reasoning for m in on)
    assert on[0].reasoning_open is opens
    head = text_of(qwen, on[0]).removesuffix("<think>\n")
    assert text_of(qwen, off) == head + "<think>\n\n</think>\n\n"
    assert not off.reasoning and not off.reasoning_open
    assert off.parse_output("Sure.").content == "Sure."  # the output is the answer
    plain = FakeEchoSupervisor(max_position=4096)  # a model that does not reason ignores it
    assert messages(plain, thinking={"type": "disabled"}).prompt_token_ids == messages(plain).prompt_token_ids


def test_display_effort_and_fields_it_does_not_know_are_accepted(catalog):
    base = messages(catalog)
    today = messages(catalog, thinking={"type": "adaptive", "display": "omitted"}, output_config={"effort": "xhigh"},
                     speed="fast", diagnostics={"trace": True}, cache_control={"type": "ephemeral"},
                     context_management={"edits": [{"type": "clear_tool_uses_20250919"}, {"type": "compact_20260112"}]})
    assert today.prompt_token_ids == base.prompt_token_ids and not today.reasoning_shown and base.reasoning_shown
    assert messages(catalog, thinking={"type": "adaptive", "display": "summarized"}).reasoning_shown


def test_tool_choice_maps_to_constrained_decoding(catalog):
    assert messages(catalog, tools=TOOLS).sampling.grammar is None  # auto
    assert "ls" in messages(catalog, tools=TOOLS, tool_choice={"type": "tool", "name": "ls"}).sampling.grammar
    assert messages(catalog, tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True}).sampling.grammar
    none = messages(catalog, tools=TOOLS, tool_choice={"type": "none"})
    assert none.tool_format is None and "<tools>" not in text_of(catalog, none)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    formatted = messages(catalog, output_config={"format": {"type": "json_schema", "schema": schema}})
    assert formatted.sampling.grammar


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


@pytest.mark.parametrize("body, status, match", [
    ({"model": "nope"}, 404, "The model 'nope' does not exist"),
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, 400, r"messages\[0\].content\[0\]: image blocks are not"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, 400, "document blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "ls", "input": {}}]}]},
     400, "a 'tool_use' block is not supported in a user message"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, r'role must be "user", "assistant" or "system"'),
    ({"messages": [{"role": "user", "content": [{"type": "fallback"}]}]}, 400, "unknown content block type 'fallback'"),
    ({"thinking": {"type": "enabled", "budget_tokens": "lots"}}, 400, "thinking.budget_tokens must be an integer"),
    ({"thinking": {"type": "adaptive", "display": True}}, 400, "thinking.display must be a non-empty string"),
    ({"output_config": {"effort": 3}}, 400, "output_config.effort must be a non-empty string"),
    ({"context_management": {"edits": {"type": "clear_thinking_20251015"}}}, 400, "context_management.edits must be"),
    ({"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": 2}]}}, 400,
     r"context_management.edits\[0\].keep must be"),
    ({"context_management": {"edits": [{"type": "clear_thinking_20251015",
                                        "keep": {"type": "thinking_turns", "value": -1}}]}}, 400,
     r"context_management.edits\[0\].keep.value must be an integer >= 0"),
    ({"tools": [{**TOOLS[0], "defer_loading": "yes"}]}, 400, r"tools\[0\].defer_loading must be a boolean"),
    ({"messages": []}, 400, "messages must be a non-empty array"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "not the server tool 'web_search_20250305'"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "rm"}}, 400, "tool_choice names function 'rm'"),
    ({"tool_choice": {"type": "sometimes"}}, 400, "tool_choice.type must be"),
    ({"thinking": {"type": "always"}}, 400, "thinking must be"),
    ({"stop_sequences": "END"}, 400, "stop_sequences must be an array"),
    ({"temperature": 1.5}, 400, "temperature"),
    ({"metadata": {"user_id": 7}}, 400, "metadata.user_id must be a string"),
    ({"system": [{"type": "image"}]}, 400, r"system\[0\] must be a text block"),
    ({"output_config": {"format": {"type": "json"}}}, 400, "output_config.format must be"),
    ({"max_tokens": 0}, 400, "max_tokens"),
])
def test_bad_requests_are_refused_naming_what_is_wrong(catalog, body, status, match):
    with pytest.raises(APIError, match=match) as e:
        parse_messages({"model": MODEL, "max_tokens": 10, "messages": ASK, **body}, catalog, SERVER)
    assert e.value.status == status
    shaped = error_body(e.value)
    assert shaped["type"] == "error" and shaped["error"]["type"] == (
        "not_found_error" if status == 404 else "invalid_request_error")


# ---- responses ---------------------------------------------------------------------------------

OUTPUT = '<think>ls is the tool</think>Sure.<tool_call>\n{"name": "ls", "arguments": {"path": "src"}}\n</tool_call>'
USAGE = Usage(prompt_tokens=120, completion_tokens=30, cached_tokens=100)


def ids():
    n = iter(range(100))
    return lambda: f"toolu_{next(n)}"


def streamed(text: str, pieces: int = 7, show_thinking: bool = True) -> list[tuple[str, dict]]:
    fmt, parser = MessageFormat("msg_1", MODEL, ids(), show_thinking), OutputParser(ToolParser.HERMES, reasoning=True)
    raw = fmt.start(120)
    step = -(-len(text) // pieces)
    for i in range(0, len(text), step):
        raw += b"".join(fmt.event_chunk(e) for e in parser.feed(text[i:i + step]))
    raw += b"".join(fmt.event_chunk(e) for e in parser.finish())
    raw += fmt.end("stop", USAGE, None)
    frames = [f.split("\n") for f in raw.decode().strip().split("\n\n")]
    return [(head.removeprefix("event: "), json.loads(data.removeprefix("data: "))) for head, data in frames]


def assemble(events: list[tuple[str, dict]]) -> dict:
    """What a client puts together from the stream (as the SDK's stream helper does)."""
    message = events[0][1]["message"]
    partial: dict[int, str] = {}
    for kind, data in events:
        if kind == "content_block_start":
            message["content"].append(data["content_block"])
        elif kind == "content_block_delta":
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "input_json_delta":
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
            else:
                key = delta["type"].removesuffix("_delta")
                block[key] += delta[key]
        elif kind == "content_block_stop" and data["index"] in partial:
            message["content"][data["index"]]["input"] = json.loads(partial[data["index"]])
        elif kind == "message_delta":
            message |= data["delta"]
            message["usage"] = data["usage"]
    return message


def test_a_stream_puts_together_to_the_whole_message():
    events = streamed(OUTPUT)
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"]["type"] for k, d in events if k == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert {d["delta"]["type"] for k, d in events if k == "content_block_delta"} == {
        "thinking_delta", "text_delta", "input_json_delta"}
    whole = MessageFormat("msg_1", MODEL, ids()).whole(OUTPUT, parse(OUTPUT, ToolParser.HERMES, True), "stop",
                                                       USAGE, None)
    assert assemble(events) == whole
    assert whole["stop_reason"] == "tool_use" and whole["content"][2]["input"] == {"path": "src"}
    assert whole["usage"] == {"input_tokens": 20, "output_tokens": 30, "cache_read_input_tokens": 100,
                              "cache_creation_input_tokens": 0}


@pytest.mark.parametrize("finish, called, stop, reason", [
    ("stop", False, None, "end_turn"), ("length", False, None, "max_tokens"), ("length", True, None, "max_tokens"),
    ("stop", False, "END", "stop_sequence"), ("stop", True, None, "tool_use"),
])
def test_stop_reasons(finish, called, stop, reason):
    text = '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>' if called else "Done."
    whole = MessageFormat("msg_1", MODEL, ids()).whole(text, parse(text, ToolParser.HERMES, False), finish,
                                                       USAGE, stop)
    assert (whole["stop_reason"], whole["stop_sequence"]) == (reason, stop)


def test_arguments_cut_short_give_an_empty_input():
    text = '<tool_call>\n{"name": "ls", "arguments": {"path": "sr'
    whole = MessageFormat("msg_1", MODEL, ids()).whole(text, parse(text, ToolParser.HERMES, False), "length",
                                                       USAGE, None)
    assert whole["content"][-1]["input"] == {} and whole["stop_reason"] == "max_tokens"


def test_display_omitted_returns_thinking_blocks_without_their_text():
    events = streamed(OUTPUT, show_thinking=False)
    assert "thinking_delta" not in {d["delta"]["type"] for k, d in events if k == "content_block_delta"}
    assert [d["content_block"]["type"] for k, d in events if k == "content_block_start"] == ["thinking", "text", "tool_use"]
    whole = MessageFormat("msg_1", MODEL, ids(), show_thinking=False).whole(
        OUTPUT, parse(OUTPUT, ToolParser.HERMES, True), "stop", USAGE, None)
    assert assemble(events) == whole and whole["content"][0] == {"type": "thinking", "thinking": "", "signature": ""}
    assert whole["content"][1:] == MessageFormat("msg_1", MODEL, ids()).whole(
        OUTPUT, parse(OUTPUT, ToolParser.HERMES, True), "stop", USAGE, None)["content"][1:]
