"""Anthropic Messages API request bodies (`POST /v1/messages`, `/v1/messages/count_tokens`), parsed.

A Messages request becomes the same `ParsedRequest` a chat completion does: its turns are converted
to the chat shape (talaria/gateway/anthropic_conversation.py has the block rules), `system` (a
string or text blocks) becomes the first system message, and its tools and `tool_choice` a `Tools`
(`any` is "required", `tool` a named function, both constrained). `cache_control` is accepted
anywhere (Talaria caches every prefix); server tools are refused by name; `output_config.format` (a
JSON schema) constrains the answer as `response_format` does on chat. Fields and headers it does
not know (new betas: `speed`, `diagnostics`, `anthropic-beta`, `x-app`, ...) are accepted and
ignored, as Anthropic's API ignores betas a model lacks. Choices where the API leaves room, all in
docs/api.md, each made so that an agent's next prompt extends its last (the prefix stays cached):
- `max_tokens` is required; larger than the context left after the prompt, the call runs with
  what is left (and reports `stop_reason: "max_tokens"` when that binds), because agents send 32000
  whatever the model.
- the session: the `X-Session-Id` header, else `metadata.user_id`'s session — the `session_id` of
  its JSON form (`{"device_id": ..., "account_uuid": ..., "session_id": ...}`, Claude Code 2.1 on)
  or its `_session_<id>` ending (earlier versions) — else inferred from the conversation as for chat.
- `thinking`: `enabled` and `adaptive` let a reasoning model reason (its template's default, also
  when the field is absent; `budget_tokens` is not enforced, `max_tokens` bounds the answer);
  `disabled` makes it answer without reasoning (talaria/gateway/chat_prompt.py); `display:
  "omitted"` returns its thinking blocks empty. A model that does not reason ignores all of it.
- `output_config.effort` is accepted and ignored: the model reasons as its template says.
- `context_management.edits`: a `clear_thinking_*` edit's `keep` says which earlier turns' thinking
  is shown to the model (`"all"`, or the latest N turns with thinking; N = 1 when absent); without
  one no earlier thinking is. Other edits (`clear_tool_uses_*`) are accepted and ignored: the
  prompt keeps every tool result, so it only grows.
- tools with `defer_loading: true` are left out of the tools the template lists and shown where
  the conversation loads them (anthropic_conversation.py).
- the `x-anthropic-billing-header: ...` line Claude Code puts first in the system prompt differs
  on every request; with `[server] strip_billing_header` (on by default) it is dropped, so call k+1
  of a session reuses call k's prefix.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from talaria.config.schema import ServerConfig
from talaria.contracts.call import SamplingParams
from talaria.gateway.anthropic_conversation import BlockRules, conversation, text_block
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
THINKING_TYPES = ("enabled", "disabled", "adaptive")
KEEP_ALL = ("all", {"type": "all"})  # a clear_thinking edit's `keep` that shows every turn's thinking
DEFAULT_KEEP_TURNS = 1  # a clear_thinking edit without `keep`: the latest turn's thinking (Anthropic's default)


@dataclass(frozen=True, slots=True)
class Thinking:
    """The request's `thinking`, as far as a model Talaria serves can honour it."""

    on: bool = True  # a reasoning model reasons (False: `{"type": "disabled"}`)
    shown: bool = True  # its reasoning's text is returned (False: `display: "omitted"`)


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
    thinking = _thinking(f)
    session = _session_of(f)  # read (and so checked) even where the header names the session
    for value, param in ((session, "metadata.user_id"), (header_session_id, "X-Session-Id")):
        if value is not None and len(value) > MAX_SESSION_ID_CHARS:
            raise APIError.invalid(f"the session id must be at most {MAX_SESSION_ID_CHARS} characters", param)
    session = header_session_id or session

    tools = _tools(f)
    definitions = {d["function"]["name"]: d for d in tools.definitions} if tools is not None else {}
    rules = BlockRules(definitions, _kept_thinking(f))
    messages = _system(f, server.strip_billing_header) + conversation(f.get("messages"), rules)
    arch, tokenizer = catalog.arch(model), catalog.tokenizer(model)
    chat = build_chat_prompt(catalog, model, messages, tools, _output_format(f), prompts,
                             format_param="output_config.format", thinking=thinking.on)
    room = arch.max_position - len(chat.ids)
    if room <= 0 and not count_only:  # a count is what tells a client its prompt is too long
        raise APIError.invalid(f"prompt is too long: {len(chat.ids)} tokens > {arch.max_position - 1} maximum",
                               "messages", "context_length_exceeded")
    sampling = SamplingParams(max_tokens=min(max_tokens or 1, room), temperature=temperature, top_p=top_p,
                              top_k=top_k or 0, stop_token_ids=tuple(tokenizer.eos_token_ids), grammar=chat.grammar)
    return ParsedRequest(Endpoint.MESSAGES, model, chat.ids, sampling, stream, False, stops, session,
                         chat.tool_format, chat.reasoning, messages, cache_salt(f),
                         tool_schemas=chat.tool_schemas, reasoning_open=chat.reasoning_open,
                         reasoning_shown=thinking.shown)


def _output_format(f: Fields) -> str | None:
    """`output_config.format` (structured outputs): a JSON schema the answer must follow, constrained.
    `output_config.effort` is checked and ignored."""
    config = f.object("output_config")
    if config is None:
        return None
    Fields(config, "output_config.").string("effort")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError.invalid('output_config.format must be {"type": "json_schema", "schema": {...}}',
                               "output_config.format")
    return response_format_grammar(Fields({"response_format": {"type": "json_schema",
                                                               "json_schema": {"schema": fmt["schema"]}}}))


def _session_of(f: Fields) -> str | None:
    """`metadata.user_id`'s session: the `session_id` of its JSON form, else its `_session_<id>` ending."""
    metadata = f.object("metadata")
    if metadata is None:
        return None
    user = metadata.get("user_id")
    if user is None:
        return None
    if not isinstance(user, str):
        raise APIError.invalid("metadata.user_id must be a string", "metadata.user_id")
    if user.startswith("{"):
        try:
            fields = json.loads(user)
        except ValueError:
            fields = None
        if isinstance(fields, dict):
            session = fields.get("session_id")
            return session if isinstance(session, str) and session else None
    found = SESSION_IN_USER_ID.search(user)
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


def _thinking(f: Fields) -> Thinking:
    """`thinking` in its documented shapes; what a model makes of it is in the module docstring."""
    thinking = f.get("thinking")
    if thinking is None:
        return Thinking()
    if not isinstance(thinking, dict) or thinking.get("type") not in THINKING_TYPES:
        raise APIError.invalid('thinking must be {"type": "enabled", "budget_tokens": N}, {"type": "disabled"} '
                               'or {"type": "adaptive"}', "thinking")
    fields = Fields(thinking, "thinking.")
    fields.integer("budget_tokens", minimum=0)
    display = fields.string("display")  # "summarized" (the default), "omitted"; later kinds show the text
    return Thinking(on=thinking["type"] != "disabled", shown=display != "omitted")


def _kept_thinking(f: Fields) -> int | None:
    """How many of the latest assistant turns with thinking show it to the model (None: all), by the
    request's `clear_thinking_*` edit; 0 without one. Other edits are ignored (module docstring)."""
    management = f.object("context_management")
    edits = management.get("edits", []) if management is not None else []
    if not isinstance(edits, list):
        raise APIError.invalid("context_management.edits must be an array", "context_management.edits")
    kept: int | None = 0
    for i, edit in enumerate(edits):
        where = f"context_management.edits[{i}]"
        kind = edit.get("type") if isinstance(edit, dict) else None
        if not isinstance(kind, str):
            raise APIError.invalid(f'{where} must be an edit {{"type": ...}}', where)
        if not kind.startswith("clear_thinking_"):
            continue
        keep = edit.get("keep", {"type": "thinking_turns", "value": DEFAULT_KEEP_TURNS})
        if keep in KEEP_ALL:
            kept = None
        elif isinstance(keep, dict) and keep.get("type") == "thinking_turns":
            kept = Fields(keep, f"{where}.keep.").integer("value", minimum=0)
            if kept is None:
                raise APIError.invalid(f"{where}.keep.value: field required", f"{where}.keep.value")
        else:
            raise APIError.invalid(f'{where}.keep must be "all", {{"type": "all"}} or '
                                   f'{{"type": "thinking_turns", "value": N}}', f"{where}.keep")
    return kept


def _system(f: Fields, strip_billing: bool) -> list[dict[str, Any]]:
    system = f.get("system")
    if system is None or system == "" or system == []:
        return []
    if isinstance(system, str):
        texts = [system]
    elif isinstance(system, list):
        texts = [text_block(block, f"system[{i}]") for i, block in enumerate(system)]
    else:
        raise APIError.invalid("system must be a string or an array of text blocks", "system")
    if strip_billing:
        texts = [t for t in (_without_billing_line(t) for t in texts) if t]
    return [{"role": "system", "content": "\n\n".join(texts)}] if texts else []


def _without_billing_line(text: str) -> str:
    return "\n".join(line for line in text.split("\n") if not line.startswith(BILLING_HEADER)).strip("\n")


def _tools(f: Fields) -> Tools | None:
    """Anthropic's tools and tool_choice, as the chat shape parse_tools reads; `defer_loading` ones
    marked deferred (Tools.deferred)."""
    tools = f.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise APIError.invalid("tools must be an array", "tools")
    functions, deferred = [], []
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict) or (tool.get("type") or "custom") != "custom" or "input_schema" not in tool:
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError.invalid(f"tools[{i}]: only client tools with an input_schema are supported "
                                   f"(not the server tool {kind!r})", f"tools[{i}]")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        functions.append({"type": "function", "function": fn})
        if Fields(tool, f"tools[{i}].").boolean("defer_loading", False):
            deferred.append(tool.get("name"))
    choice, parallel = f.get("tool_choice"), True
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise APIError.invalid('tool_choice.type must be "auto", "any", "tool" or "none"', "tool_choice")
        parallel = not Fields(choice, "tool_choice.").boolean("disable_parallel_tool_use", False)
        choice = {"auto": "auto", "none": "none", "any": "required",
                  "tool": {"type": "function", "function": {"name": choice.get("name")}}}[kind]
    parsed = parse_tools(Fields({"tools": functions, "tool_choice": choice, "parallel_tool_calls": parallel}))
    return dataclasses.replace(parsed, deferred=frozenset(deferred)) if parsed is not None and deferred else parsed
