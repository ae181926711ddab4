"""OpenAI response bodies and SSE chunks for chat and text completions.

One `ResponseFormat` per request carries the fields every chunk repeats (id, created, model) so the
per-token path only builds the small `choices` dict and one `json.dumps`. Shapes follow OpenAI's
API reference: chunks `chat.completion.chunk` / `text_completion`, a role-only first chat chunk, an
empty-delta chunk carrying `finish_reason`, with `stream_options.include_usage` a `"usage": null` on
every chunk plus a last chunk with `"choices": []` and the usage, then `data: [DONE]`.

A chat output parsed into reasoning, content and tool calls (talaria/gateway/output_parser.py) streams
as `delta.reasoning_content`, `delta.content` and `delta.tool_calls` (index, id, type and name first,
then the arguments in pieces); the whole response has them in `message`. A turn that made tool calls
and ended by itself finishes with `"tool_calls"`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from talaria.contracts.call import Usage
from talaria.gateway.errors import APIError
from talaria.gateway.openai_protocol import Endpoint
from talaria.gateway.output_parser import (
    CallStart,
    Content,
    Event,
    ParsedOutput,
    Reasoning,
)

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class ResponseFormat:
    """Builds the bodies of one request's response, streamed or whole."""

    __slots__ = ("_call_id", "_calls", "_chat", "_content", "_head", "_include_usage", "_message_sent")

    def __init__(self, endpoint: Endpoint, response_id: str, created: int, model: str,
                 include_usage: bool = False, call_id: Callable[[], str] = lambda: "call_0") -> None:
        self._chat = endpoint is Endpoint.CHAT
        self._include_usage = include_usage
        self._call_id = call_id  # a fresh tool-call id
        self._calls: list[dict[str, Any]] = []  # tool calls streamed so far, as the message lists them
        self._content: list[str] = []  # content streamed so far
        self._message_sent: dict[str, Any] | None = None  # the whole response's message
        obj = "chat.completion.chunk" if self._chat else "text_completion"
        self._head = {"id": response_id, "object": obj, "created": created, "model": model}

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        body = {**self._head, "choices": [choice]}
        if self._include_usage:
            body["usage"] = None
        return sse(body)

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if not self._chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def first_chunk(self) -> bytes | None:
        """Chat streams open with the assistant role; text completions have no such chunk."""
        return self._chunk(self._choice("", None, role=True)) if self._chat else None

    def text_chunk(self, text: str) -> bytes:
        self._content.append(text)
        return self._chunk(self._choice(text, None))

    def event_chunk(self, event: Event) -> bytes:
        """One event of a parsed chat output as a chunk."""
        if isinstance(event, Content):
            return self.text_chunk(event.text)
        if isinstance(event, Reasoning):
            delta: dict[str, Any] = {"reasoning_content": event.text}
        elif isinstance(event, CallStart):
            call = {"id": self._call_id(), "type": "function", "function": {"name": event.name, "arguments": ""}}
            self._calls.append(call)
            delta = {"tool_calls": [{"index": event.index, **call, "function": dict(call["function"])}]}
        else:
            self._calls[event.index]["function"]["arguments"] += event.text
            delta = {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
        return self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})

    def finish_reason(self, finish_reason: str) -> str:
        """OpenAI's reason: a turn that called tools and ended by itself ended to call them."""
        return "tool_calls" if self._calls and finish_reason == "stop" else finish_reason

    def streamed_message(self) -> dict[str, Any]:
        """The assistant message a client assembles from the chunks sent (what it sends back next turn)."""
        return self._message("".join(self._content), self._calls)

    def finish_chunk(self, finish_reason: str) -> bytes:
        return self._chunk(self._choice(None, finish_reason))

    def usage_chunk(self, usage: Usage) -> bytes:
        return sse({**self._head, "choices": [], "usage": usage_json(usage)})

    # ---- the interface the gateway drives (talaria/gateway/anthropic_responses.py has the same) ----

    def start(self, prompt_tokens: int) -> bytes:
        return self.first_chunk() or b""

    def end(self, finish_reason: str, usage: Usage | None, stop_sequence: str | None) -> bytes:
        out = self.finish_chunk(self.finish_reason(finish_reason))
        if self._include_usage and usage is not None:
            out += self.usage_chunk(usage)
        return out + DONE

    def error_chunk(self, error: APIError) -> bytes:
        """In-band, once the headers are sent; the stream then ends without [DONE]."""
        return sse(error.body())

    def reply_message(self) -> dict[str, Any] | None:
        """A chat answer as the assistant message the client appends to the conversation."""
        if not self._chat:
            return None
        return self._message_sent if self._message_sent is not None else self.streamed_message()

    def whole(self, text: str, parsed: ParsedOutput | None, finish_reason: str, usage: Usage,
              stop_sequence: str | None = None) -> dict[str, Any]:
        """The non-streaming response body; `parsed`: the chat output parsed (None: plain text)."""
        if self._chat:
            if parsed is None:
                message = self._message(text, [])
            else:
                self._calls = [{"id": self._call_id(), "type": "function", "function": {"name": n, "arguments": a}}
                               for n, a in parsed.tool_calls]
                message = self._message(parsed.content, self._calls)
                if parsed.reasoning is not None:
                    message["reasoning_content"] = parsed.reasoning
            self._message_sent = message
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": self.finish_reason(finish_reason)}
            obj = "chat.completion"
        else:
            choice = self._choice(text, finish_reason)
            obj = "text_completion"
        return {**self._head, "object": obj, "choices": [choice], "usage": usage_json(usage)}

    @staticmethod
    def _message(content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return message
