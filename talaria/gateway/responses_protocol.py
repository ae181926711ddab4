"""OpenAI Responses API request bodies (`POST /v1/responses`), parsed.

A Responses request becomes the same `ParsedRequest` a chat completion does, so it takes the same
path from there: routing, sessions, tenants, limits, constrained decoding, output parsing,
cancellation and metrics. Its `input` items are converted to the chat shape
(talaria/gateway/responses_input.py has the item rules); `instructions` becomes the first system
message. What the response needs beyond that (the fields it echoes, the namespaces, what to
include, where to store it) travels as `ParsedRequest.api`, a `ResponsesRequest`.

Choices where the API leaves room, all in docs/api.md, each made so that an agent's next prompt
extends its last:
- The session: `prompt_cache_key`, else the `session-id` header (OpenAI's coding agent sends both,
  the same UUID), else the body's `session_id`, else `X-Session-Id`, else inferred from the
  conversation as for chat.
- Tools: `function`s; a `namespace`'s functions under one name each (`offered_name`); every other
  type is a hosted tool (`web_search`, `file_search`, `computer_use_preview`, `code_interpreter`,
  `image_generation`, `mcp`, `local_shell`, ...) that the node cannot run: left out of the prompt,
  and echoed back as sent — agents always send them, so they are not refused. `custom` (freeform)
  tools are refused: a model asked for free text with no grammar would be guessing its format.
- `max_output_tokens`: larger than the context left, the call runs with what is left (status
  `incomplete` when that binds); absent, the context left, at most `DEFAULT_MAX_OUTPUT_TOKENS`.
- `reasoning.effort: "none"` makes a reasoning model answer without reasoning (chat_prompt.py);
  other efforts let it reason as its template does. `reasoning.summary` set returns the reasoning's
  text as its summary (there is no summarizer: the summary is the text); unset, reasoning items
  carry no text. `include: ["reasoning.encrypted_content"]` adds the opaque copy that renders the
  same tokens when it comes back.
- `truncation: "auto"` drops the oldest turns after the system messages until the prompt fits;
  `"disabled"` (the default) refuses a prompt that does not fit.
- `store` (default true) keeps the response for `previous_response_id` (talaria/gateway/response_store.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from talaria.contracts.call import SamplingParams
from talaria.gateway.chat_prompt import ChatPrompt, build_chat_prompt
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
from talaria.gateway.response_store import ResponseStore
from talaria.gateway.responses_input import Namespaces, conversation, offered_name
from talaria.gateway.tools import Tools, parse_tools

DEFAULT_MAX_OUTPUT_TOKENS = 4096
ENCRYPTED = "reasoning.encrypted_content"
EFFORTS = (None, "none", "minimal", "low", "medium", "high", "xhigh")
SUMMARIES = (None, "auto", "concise", "detailed")


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """What a Responses call's response needs from its request."""

    echo: dict[str, Any]  # the request's fields the response object repeats (instructions, tools, ...)
    items: tuple[dict[str, Any], ...]  # its conversation's items: the previous response's chain, then `input`
    namespaces: Namespaces  # offered function name -> (namespace, name)
    summary: bool  # reasoning items carry the reasoning's text as their summary
    encrypted: bool  # reasoning items carry `encrypted_content`
    store: bool  # kept for `previous_response_id`
    tenant: str  # whose store


def parse_responses(body: Any, catalog: ModelCatalog, store: ResponseStore, tenant: str,
                    header_session_id: str | None = None, prompts: PromptCache | None = None) -> ParsedRequest:
    """Validate a Responses request; raise APIError (OpenAI's shape) on any problem.
    `header_session_id`: the `session-id` header, else `X-Session-Id`."""
    f = request_fields(body)
    model = served_model(f, catalog)
    max_tokens = f.integer("max_output_tokens", minimum=1)
    temperature = f.number("temperature", 1.0, low=0.0, high=2.0)
    top_p = f.number("top_p", 1.0, low=0.0, high=1.0, low_open=True)
    top_k = f.integer("top_k", minimum=-1, maximum=MAX_TOP_K)
    seed = f.integer("seed", minimum=-(1 << 63), maximum=(1 << 64) - 1)
    stream = f.boolean("stream", False)
    saved = f.boolean("store", True)
    session = f.string("prompt_cache_key") or f.string("session_id") or header_session_id
    if session is not None and len(session) > MAX_SESSION_ID_CHARS:
        raise APIError.invalid(f"prompt_cache_key must be at most {MAX_SESSION_ID_CHARS} characters",
                               "prompt_cache_key")
    _refuse_unsupported(f)
    effort, summary = _reasoning(f)
    include = f.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise APIError.invalid("include must be an array of strings", "include")
    truncation = f.get("truncation") or "disabled"
    if truncation not in ("auto", "disabled"):
        raise APIError.invalid('truncation must be "auto" or "disabled"', "truncation")
    metadata = f.object("metadata")

    items = _items(f)
    previous_id = f.string("previous_response_id")
    history = store.get(tenant, previous_id) if previous_id is not None else None
    earlier = history.items + history.output if history is not None else ()
    tools, namespaces = _tools(f)
    messages = conversation(list(earlier) + items, namespaces, first=-len(earlier))
    instructions = f.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise APIError.invalid("instructions must be a string", "instructions")
    head = [{"role": "system", "content": instructions}] if instructions else []

    arch, tokenizer = catalog.arch(model), catalog.tokenizer(model)
    grammar = _text_format(f)
    thinking = effort != "none"
    chat = build_chat_prompt(catalog, model, head + messages, tools, grammar, prompts, format_param="text.format",
                             thinking=thinking)
    while len(chat.ids) >= arch.max_position and truncation == "auto" and _droppable(messages):
        messages = _drop_oldest_turn(messages)
        chat = build_chat_prompt(catalog, model, head + messages, tools, grammar, None, format_param="text.format",
                                 thinking=thinking)
    room = arch.max_position - len(chat.ids)
    if room <= 0:
        raise APIError.invalid(f"This model's maximum context length is {arch.max_position} tokens. However, your "
                               f"input resulted in {len(chat.ids)} tokens. Please reduce the length of the input "
                               '(or send truncation: "auto").', "input", "context_length_exceeded")
    max_tokens = min(max_tokens, room) if max_tokens is not None else min(room, DEFAULT_MAX_OUTPUT_TOKENS)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              top_k=0 if top_k in (None, -1) else top_k, seed=seed,
                              stop_token_ids=tuple(tokenizer.eos_token_ids), grammar=chat.grammar)
    echo = {"instructions": instructions, "max_output_tokens": f.get("max_output_tokens"), "metadata": metadata or {},
            "parallel_tool_calls": f.boolean("parallel_tool_calls", True), "previous_response_id": previous_id,
            "prompt_cache_key": f.get("prompt_cache_key"), "reasoning": {"effort": effort, "summary": summary},
            "store": saved, "temperature": temperature, "text": f.get("text") or {"format": {"type": "text"}},
            "tool_choice": f.get("tool_choice") or "auto", "tools": f.get("tools") or [], "top_p": top_p,
            "truncation": truncation, "user": f.get("user")}
    api = ResponsesRequest(echo, tuple(earlier) + tuple(items), namespaces, summary is not None,
                           ENCRYPTED in include, saved, tenant)
    return _parsed(model, chat, sampling, stream, session, head + messages, cache_salt(f), api)


def _parsed(model: str, chat: ChatPrompt, sampling: SamplingParams, stream: bool, session: str | None,
            messages: list[dict[str, Any]], salt: str | None, api: ResponsesRequest) -> ParsedRequest:
    return ParsedRequest(Endpoint.RESPONSES, model, chat.ids, sampling, stream, False, (), session,
                         chat.tool_format, chat.reasoning, messages, salt, tool_schemas=chat.tool_schemas,
                         reasoning_open=chat.reasoning_open, api=api)


def _items(f: Fields) -> list[Any]:
    value = f.get("input")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise APIError.invalid("input must be a string or a non-empty array of items", "input")
    return value


def _refuse_unsupported(f: Fields) -> None:
    """400 for what a client would otherwise believe was honoured."""
    if f.get("top_logprobs") not in (None, 0):
        raise APIError.invalid("top_logprobs is not supported", "top_logprobs")
    if f.boolean("background", False):
        raise APIError.invalid("background responses are not supported: send the request and wait, or stream it",
                               "background")
    if f.get("conversation") is not None:
        raise APIError.invalid("conversation objects are not supported; use previous_response_id or send the items",
                               "conversation")
    if f.get("prompt") is not None:
        raise APIError.invalid("prompt templates (prompt.id) are not supported; send instructions and input",
                               "prompt")
    include = f.get("include")
    if isinstance(include, list) and "message.output_text.logprobs" in include:
        raise APIError.invalid("logprobs are not supported", "include")


def _reasoning(f: Fields) -> tuple[str | None, str | None]:
    reasoning = f.object("reasoning") or {}
    effort = reasoning.get("effort")
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    if effort not in EFFORTS:
        raise APIError.invalid(f"reasoning.effort must be one of {[e for e in EFFORTS if e]}", "reasoning.effort")
    if summary not in SUMMARIES:
        raise APIError.invalid('reasoning.summary must be "auto", "concise" or "detailed"', "reasoning.summary")
    return effort, summary


def _text_format(f: Fields) -> str | None:
    """`text.format` as the chat `response_format` grammar; `text.verbosity` is accepted and ignored."""
    text = f.object("text")
    fmt = text.get("format") if text is not None else None
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError.invalid("text.format.schema must be a JSON schema object", "text.format.schema")
        spec = {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}
    elif kind in ("json_object", "text"):
        spec = {"type": kind}
    else:
        raise APIError.invalid('text.format.type must be "text", "json_object" or "json_schema"', "text.format.type")
    try:
        return response_format_grammar(Fields({"response_format": spec}))
    except APIError as e:
        raise APIError.invalid(e.message.replace("response_format", "text.format"), "text.format") from None


def _tools(f: Fields) -> tuple[Tools | None, Namespaces]:
    """The request's function tools (namespaces' functions under their offered names) as parse_tools
    reads them; hosted tools are left out (the module docstring)."""
    raw = f.get("tools") or []
    if not isinstance(raw, list):
        raise APIError.invalid("tools must be an array", "tools")
    functions: list[dict[str, Any]] = []
    namespaces: dict[str, tuple[str, str]] = {}
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            functions.append(_function(tool, f"tools[{i}]"))
        elif kind == "namespace":
            name, inner = tool.get("name"), tool.get("tools")
            if not isinstance(name, str) or not name or not isinstance(inner, list):
                raise APIError.invalid(f'tools[{i}] must be {{"type": "namespace", "name": ..., "tools": [...]}}',
                                       f"tools[{i}]")
            for j, fn in enumerate(inner):
                where = f"tools[{i}].tools[{j}]"
                if not isinstance(fn, dict) or fn.get("type") != "function":
                    raise APIError.invalid(f"{where}: a namespace may hold function tools only here", where)
                offered = offered_name(name, str(fn.get("name")))
                namespaces[offered] = (name, fn.get("name"))
                described = "\n\n".join(d for d in (tool.get("description"), fn.get("description")) if d)
                functions.append(_function({**fn, "name": offered, "description": described or None}, where))
        elif kind == "custom":
            raise APIError.invalid(f"tools[{i}]: custom (freeform) tools are not supported; declare it as a "
                                   "function tool with JSON parameters", f"tools[{i}]")
        elif not isinstance(kind, str):
            raise APIError.invalid(f"tools[{i}] must be a tool object with a type", f"tools[{i}]")
        # every other type is a hosted tool the node cannot run: left out of the prompt
    choice = _tool_choice(f.get("tool_choice"), namespaces)
    chat = {"tools": functions, "tool_choice": choice, "parallel_tool_calls": f.boolean("parallel_tool_calls", True)}
    return parse_tools(Fields(chat)), namespaces


def _function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    fn = {"name": tool.get("name"), "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    if not isinstance(fn["name"], str):
        raise APIError.invalid(f"{where}.name must be a string", f"{where}.name")
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any, namespaces: Namespaces) -> Any:
    """The Responses API's tool_choice in chat's shape; a hosted tool cannot be forced here."""
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function" and isinstance(choice.get("name"), str):
        name, namespace = choice["name"], choice.get("namespace")
        if isinstance(namespace, str):
            name = offered_name(namespace, name)
        return {"type": "function", "function": {"name": name}}
    if kind in ("auto", "none", "required"):
        return kind
    raise APIError.invalid(f'tool_choice must be "auto", "none", "required" or {{"type": "function", "name": ...}} '
                           f"(not {kind!r}: Talaria runs no hosted tools, and allowed_tools is not supported)",
                           "tool_choice")


def _droppable(messages: list[dict[str, Any]]) -> bool:
    return sum(m["role"] != "system" for m in messages) > 1


def _drop_oldest_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Without the oldest message after the leading system ones, and the tool results it left unanswered."""
    lead = next(i for i, m in enumerate(messages) if m["role"] != "system")
    rest = messages[lead + 1:]
    while rest and rest[0]["role"] == "tool":
        rest = rest[1:]
    return messages[:lead] + rest
