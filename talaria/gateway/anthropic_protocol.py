"""Anthropic Messages API request bodies (`POST /v1/messages`, `/v1/messages/count_tokens`), parsed.

A Messages request becomes the same `ParsedRequest` a chat completion does: its content blocks are
converted to the chat shape the rest of the gateway speaks (talaria/gateway/chat_prompt.py) —
`system` (a string or text blocks) to a system message, `text` blocks to content, an assistant's
`tool_use` blocks to `tool_calls` (input as JSON text), a user's `tool_result` blocks to `tool`
messages — and its tools and `tool_choice` to a `Tools` (`any` is "required", `tool` a named
function, both constrained). `cache_control` is accepted anywhere (Talaria caches every prefix);
`thinking` blocks of earlier turns are dropped; images, documents and server tools are refused by
name. `output_config.format` (a JSON schema) constrains the answer as `response_format` does on chat. Choices where the API leaves room, all in docs/api.md:
- `max_tokens` is required; larger than the context left after the prompt, the call runs with
  what is left (and reports `stop_reason: "max_tokens"` when that binds), because agents send 32000
  whatever the model.
- the session: the `X-Session-Id` header, else the `_session_<id>` part of `metadata.user_id`,
  else inferred from the conversation as for chat.
- `thinking`: a reasoning model returns thinking blocks; any other ignores it.
- the `x-anthropic-billing-header: ...` line Claude Code puts first in the system prompt differs
  on every request; with `[server] strip_billing_header` (on by default) it is dropped, so call k+1
  of a session reuses call k's prefix.
"""

from __future__ import annotations

import json
import re
from typing import Any

from talaria.config.schema import ServerConfig
from talaria.contracts.call import SamplingParams
from talaria.gateway.chat_prompt import build_chat_prompt
from talaria.gateway.errors import APIError
from talaria.gateway.fields import Fields
from talaria.gateway.grammar import response_format_grammar
from talaria.gateway.openai_protocol import (
    MAX_SESSION_ID_CHARS,
    MAX_TOP_K,
    Endpoint,
    ModelCatalog,
    ParsedRequest,
    cache_salt,
    request_fields,
    served_model,
)
from talaria.gateway.prompt_cache import PromptCache
from talaria.gateway.tools import Tools, parse_tools

BILLING_HEADER = "x-anthropic-billing-header:"
SESSION_IN_USER_ID = re.compile(r"_session_([A-Za-z0-9_-]{1,200})$")
MAX_STOP_SEQUENCES = 16
UNSUPPORTED_BLOCKS = ("image", "document", "search_result")  # Talaria serves text-only models


def parse_messages(body: Any, catalog: ModelCatalog, server: ServerConfig, header_session_id: str | None = None,
                   prompts: PromptCache | None = None, count_only: bool = False) -> ParsedRequest:
    """Validate a Messages request; raise APIError (shaped as Anthropic's by the gateway) on any problem.
    `count_only`: /v1/messages/count_tokens, where `max_tokens` is not needed."""
    f = request_fields(body)
    model = served_model(f, catalog)
    max_tokens = f.integer("max_tokens", minimum=1)
    if max_tokens is None and not count_only:
        raise APIError.invalid("max_tokens: field required", "max_tokens")
    temperature = f.number("temperature", 1.0, low=0.0, high=1.0)
    top_p = f.number("top_p", 1.0, low=0.0, high=1.0, low_open=True)
    top_k = f.integer("top_k", minimum=0, maximum=MAX_TOP_K)
    stream = f.boolean("stream", False)
    stops = _stop_sequences(f)
    _thinking(f)
    session = header_session_id or _session_of(f)
    if session is not None and len(session) > MAX_SESSION_ID_CHARS:
        raise APIError.invalid(f"the session id must be at most {MAX_SESSION_ID_CHARS} characters", "metadata.user_id")

    messages = _system(f, server.strip_billing_header) + _conversation(f)
    tools = _tools(f)
    arch, tokenizer = catalog.arch(model), catalog.tokenizer(model)
    chat = build_chat_prompt(catalog, model, messages, tools, _output_format(f), prompts,
                             format_param="output_config.format")
    room = arch.max_position - len(chat.ids)
    if room <= 0 and not count_only:  # a count is what tells a client its prompt is too long
        raise APIError.invalid(f"prompt is too long: {len(chat.ids)} tokens > {arch.max_position - 1} maximum",
                               "messages", "context_length_exceeded")
    sampling = SamplingParams(max_tokens=min(max_tokens or 1, room), temperature=temperature, top_p=top_p,
                              top_k=top_k or 0, stop_token_ids=tuple(tokenizer.eos_token_ids), grammar=chat.grammar)
    return ParsedRequest(Endpoint.MESSAGES, model, chat.ids, sampling, stream, False, stops, session,
                         chat.tool_format, chat.reasoning, messages, cache_salt(f),
                         tool_schemas=chat.tool_schemas, reasoning_open=chat.reasoning_open)


def _output_format(f: Fields) -> str | None:
    """`output_config.format` (structured outputs): a JSON schema the answer must follow, constrained."""
    config = f.object("output_config")
    fmt = config.get("format") if config is not None else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError.invalid('output_config.format must be {"type": "json_schema", "schema": {...}}',
                               "output_config.format")
    return response_format_grammar(Fields({"response_format": {"type": "json_schema",
                                                               "json_schema": {"schema": fmt["schema"]}}}))


def _session_of(f: Fields) -> str | None:
    metadata = f.object("metadata")
    if metadata is None:
        return None
    user = metadata.get("user_id")
    if user is not None and not isinstance(user, str):
        raise APIError.invalid("metadata.user_id must be a string", "metadata.user_id")
    found = SESSION_IN_USER_ID.search(user or "")
    return found.group(1) if found else None


def _stop_sequences(f: Fields) -> tuple[str, ...]:
    stops = f.get("stop_sequences")
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError.invalid("stop_sequences must be an array of non-empty strings", "stop_sequences")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise APIError.invalid(f"at most {MAX_STOP_SEQUENCES} stop_sequences are allowed", "stop_sequences")
    return tuple(dict.fromkeys(stops))


def _thinking(f: Fields) -> None:
    """Accepted in its documented shapes; what it does depends on the model (see the module docstring)."""
    thinking = f.get("thinking")
    if thinking is None:
        return
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise APIError.invalid('thinking must be {"type": "enabled", "budget_tokens": N}, {"type": "disabled"} '
                               'or {"type": "adaptive"}', "thinking")


def _system(f: Fields, strip_billing: bool) -> list[dict[str, Any]]:
    system = f.get("system")
    if system is None or system == "" or system == []:
        return []
    if isinstance(system, str):
        texts = [system]
    elif isinstance(system, list):
        texts = [_text_block(block, f"system[{i}]") for i, block in enumerate(system)]
    else:
        raise APIError.invalid("system must be a string or an array of text blocks", "system")
    if strip_billing:
        texts = [t for t in (_without_billing_line(t) for t in texts) if t]
    return [{"role": "system", "content": "\n\n".join(texts)}] if texts else []


def _without_billing_line(text: str) -> str:
    return "\n".join(line for line in text.split("\n") if not line.startswith(BILLING_HEADER)).strip("\n")


def _text_block(block: Any, where: str) -> str:
    if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
        return block["text"]
    raise APIError.invalid(f"{where} must be a text block {{\"type\": \"text\", \"text\": ...}}", where)


def _conversation(f: Fields) -> list[dict[str, Any]]:
    """The messages in chat shape: text joined, tool_use as tool_calls, tool_result as tool messages."""
    messages = f.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError.invalid("messages must be a non-empty array", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise APIError.invalid(f'{where}.role must be "user" or "assistant"', f"{where}.role")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise APIError.invalid(f"{where}.content must be a string or an array of content blocks",
                                   f"{where}.content")
        out += _turn(role, blocks, where)
    return out


def _turn(role: str, blocks: list[Any], where: str) -> list[dict[str, Any]]:
    texts, calls, results = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_use" and role == "assistant":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                    and isinstance(block.get("input"), dict)):
                raise APIError.invalid(f"{at}: a tool_use block needs an id, a name and an input object", at)
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # an earlier turn's reasoning: not shown to the model again
        elif kind in UNSUPPORTED_BLOCKS:
            raise APIError.invalid(f"{at}: {kind} blocks are not supported: Talaria serves text-only models; "
                                   "send text blocks", at)
        else:
            raise APIError.invalid(f"{at}: a {kind!r} block is not supported in a {role} message", at)
    out = results
    if role == "assistant":
        if texts or calls:
            out.append({"role": "assistant", "content": "\n".join(texts) or None, **({"tool_calls": calls} if calls else {})})
    elif texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def assistant_turn(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's content blocks in chat shape, as its next request will convert them."""
    return _turn("assistant", blocks, "content")


def _tool_result(block: dict[str, Any], at: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise APIError.invalid(f"{at}: a tool_result block needs the tool_use_id it answers", at)
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text_block(b, f"{at}.content[{k}]") for k, b in enumerate(content))
    elif not isinstance(content, str):
        raise APIError.invalid(f"{at}.content must be a string or an array of text blocks", f"{at}.content")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _tools(f: Fields) -> Tools | None:
    """Anthropic's tools and tool_choice, as the chat shape parse_tools reads."""
    tools = f.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise APIError.invalid("tools must be an array", "tools")
    functions = []
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "input_schema" not in tool:
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError.invalid(f"tools[{i}]: only client tools with an input_schema are supported "
                                   f"(not the server tool {kind!r})", f"tools[{i}]")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        functions.append({"type": "function", "function": fn})
    choice, parallel = f.get("tool_choice"), True
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise APIError.invalid('tool_choice.type must be "auto", "any", "tool" or "none"', "tool_choice")
        parallel = not choice.get("disable_parallel_tool_use", False)
        choice = {"auto": "auto", "none": "none", "any": "required",
                  "tool": {"type": "function", "function": {"name": choice.get("name")}}}[kind]
    return parse_tools(Fields({"tools": functions, "tool_choice": choice, "parallel_tool_calls": parallel}))
