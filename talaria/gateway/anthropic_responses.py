"""Anthropic Messages API responses: the whole message, or its server-sent event stream.

The parsed output (talaria/gateway/output_parser.py) becomes content blocks: `thinking` (a
reasoning model's reasoning), `text`, and `tool_use` (input: the call's arguments as an object; the
`{}` object when the model's arguments are not valid JSON, e.g. cut short by max_tokens). Streamed:
`message_start`, `ping`, then per block `content_block_start`, `content_block_delta`s
(`thinking_delta`, `text_delta`, `input_json_delta` with the arguments' JSON text as it is
generated) and `content_block_stop`, then `message_delta` (stop reason and usage) and
`message_stop`. With `thinking.display: "omitted"` a thinking block is sent with its `thinking`
empty and no `thinking_delta`s, as Anthropic's API sends it: the client learns that the model
reasoned, not what it thought (its next request's thinking blocks are then empty too).
`stop_reason`: `tool_use` for a turn that called tools and ended by itself, `stop_sequence` (with
the sequence) when one matched, `max_tokens`, else `end_turn`. Usage: `input_tokens` are the prompt
tokens computed, `cache_read_input_tokens` those served from the prefix cache (together, the
prompt), `cache_creation_input_tokens` 0 (every prefix is cached without being asked).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from talaria.contracts.call import Usage
from talaria.gateway.anthropic_conversation import assistant_turn
from talaria.gateway.errors import APIError
from talaria.gateway.output_parser import (
    CallArguments,
    CallStart,
    Event,
    ParsedOutput,
    Reasoning,
)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}


def error_body(error: APIError) -> dict[str, Any]:
    """An error in Anthropic's shape, the type chosen by status as the Anthropic SDKs expect."""
    kind = ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def event(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n".encode()


def stop_reason(finish: str, called: bool, stop_sequence: str | None) -> str:
    if stop_sequence is not None:
        return "stop_sequence"
    if finish == "length":
        return "max_tokens"
    return "tool_use" if called else "end_turn"


def usage_json(usage: Usage) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


class MessageFormat:
    """One Messages call's response, whole or streamed; `tool_id` makes a fresh `toolu_` id.
    `show_thinking` False: thinking blocks carry no text (`display: "omitted"`)."""

    def __init__(self, message_id: str, model: str, tool_id: Callable[[], str], show_thinking: bool = True) -> None:
        self._head = {"id": message_id, "type": "message", "role": "assistant", "model": model}
        self._tool_id = tool_id
        self._show_thinking = show_thinking
        self.blocks: list[dict[str, Any]] = []  # the content so far, as the client assembles it
        self._arguments: list[str] = []  # per tool_use block (by call index), its arguments text so far
        self._open: str | None = None  # the type of the block being streamed

    # ---- streamed ------------------------------------------------------------------------------

    def start(self, prompt_tokens: int) -> bytes:
        usage = {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                 "cache_creation_input_tokens": 0}
        message = {**self._head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
        return event("message_start", {"message": message}) + event("ping", {})

    def event_chunk(self, e: Event) -> bytes:
        out = b""
        if isinstance(e, CallStart):
            out += self._close()
            block = {"type": "tool_use", "id": self._tool_id(), "name": e.name, "input": {}}
            self._arguments.append("")
            return out + self._begin(block)
        if isinstance(e, CallArguments):
            self._arguments[e.index] += e.text
            return self._delta({"type": "input_json_delta", "partial_json": e.text})
        kind = "thinking" if isinstance(e, Reasoning) else "text"
        if self._open != kind:
            out += self._close()
            out += self._begin({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                               else {"type": "text", "text": ""})
        if kind == "thinking" and not self._show_thinking:
            return out
        self.blocks[-1][kind] += e.text
        return out + self._delta({"type": f"{kind}_delta", kind: e.text})

    def error_chunk(self, error: APIError) -> bytes:
        """In-band, once the headers are sent; the stream ends there."""
        return event("error", {"error": error_body(error)["error"]})

    def reply_message(self) -> dict[str, Any] | None:
        """The answer as the assistant message its next request converts it to (session continuity)."""
        turn = assistant_turn(self.blocks)
        return turn[0] if turn else None

    def end(self, finish: str, usage: Usage, stop_sequence: str | None) -> bytes:
        called = any(b["type"] == "tool_use" for b in self.blocks)
        delta = {"stop_reason": stop_reason(finish, called, stop_sequence), "stop_sequence": stop_sequence}
        return self._close() + event("message_delta", {"delta": delta, "usage": usage_json(usage)}) + \
            event("message_stop", {})

    def _begin(self, block: dict[str, Any]) -> bytes:
        self.blocks.append(block)
        self._open = block["type"]
        return event("content_block_start", {"index": len(self.blocks) - 1, "content_block": dict(block)})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": len(self.blocks) - 1, "delta": delta})

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        block = self.blocks[-1]
        if block["type"] == "tool_use":
            block["input"] = _input(self._arguments[-1])
        self._open = None
        return event("content_block_stop", {"index": len(self.blocks) - 1})

    # ---- whole ---------------------------------------------------------------------------------

    def whole(self, text: str, parsed: ParsedOutput, finish: str, usage: Usage,
              stop_sequence: str | None) -> dict[str, Any]:
        blocks: list[dict[str, Any]] = []
        if parsed.reasoning is not None:
            blocks.append({"type": "thinking", "thinking": parsed.reasoning if self._show_thinking else "",
                           "signature": ""})
        if parsed.content:
            blocks.append({"type": "text", "text": parsed.content})
        for name, arguments in parsed.tool_calls:
            blocks.append({"type": "tool_use", "id": self._tool_id(), "name": name, "input": _input(arguments)})
        self.blocks = blocks
        reason = stop_reason(finish, bool(parsed.tool_calls), stop_sequence)
        return {**self._head, "content": blocks, "stop_reason": reason, "stop_sequence": stop_sequence,
                "usage": usage_json(usage)}


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
