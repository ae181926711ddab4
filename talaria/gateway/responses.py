"""OpenAI response bodies and SSE chunks for chat and text completions.

One `ResponseFormat` per request carries the fields every chunk repeats (id, created, model) so the
per-token path only builds the small `choices` dict and one `json.dumps`. Shapes follow OpenAI's
API reference: chunks `chat.completion.chunk` / `text_completion`, a role-only first chat chunk, an
empty-delta chunk carrying `finish_reason`, with `stream_options.include_usage` a `"usage": null` on
every chunk plus a last chunk with `"choices": []` and the usage, then `data: [DONE]`.
"""

from __future__ import annotations

import json
from typing import Any

from talaria.contracts.call import Usage
from talaria.gateway.openai_protocol import Endpoint

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

    __slots__ = ("_chat", "_head", "_include_usage")

    def __init__(self, endpoint: Endpoint, response_id: str, created: int, model: str,
                 include_usage: bool = False) -> None:
        self._chat = endpoint is Endpoint.CHAT
        self._include_usage = include_usage
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
        return self._chunk(self._choice(text, None))

    def finish_chunk(self, finish_reason: str) -> bytes:
        return self._chunk(self._choice(None, finish_reason))

    def usage_chunk(self, usage: Usage) -> bytes:
        return sse({**self._head, "choices": [], "usage": usage_json(usage)})

    def whole(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        """The non-streaming response body."""
        if self._chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            obj = "chat.completion"
        else:
            choice = self._choice(text, finish_reason)
            obj = "text_completion"
        return {**self._head, "object": obj, "choices": [choice], "usage": usage_json(usage)}
