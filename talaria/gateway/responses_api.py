"""OpenAI Responses API responses: the whole response object, or its server-sent event stream.

The parsed output (talaria/gateway/output_parser.py) becomes output items, in the order the model
wrote them: `reasoning` (a reasoning model's reasoning: its text as the summary when
`reasoning.summary` asks, an opaque `encrypted_content` when `include` asks), `message` (one
`output_text` part) and `function_call` (`call_id`, `name`, `arguments` as JSON text; a namespace's
function under its own name with its `namespace`). Streamed, every event is `event: <type>` with
its JSON carrying the same `type` and a `sequence_number` counting from 0: `response.created`,
`response.in_progress`, then per item `response.output_item.added`, its parts and deltas
(`response.reasoning_summary_part.added`, `response.reasoning_summary_text.delta` / `.done`,
`response.reasoning_summary_part.done`; `response.content_part.added`, `response.output_text.delta`
/ `.done`, `response.content_part.done`; `response.function_call_arguments.delta` / `.done`) and
`response.output_item.done`, then `response.completed` — or `response.incomplete` when
`max_output_tokens` (or the context) cut the output short. An error once the stream has begun is an
`error` event followed by `response.failed`, and the stream ends there.

`usage`: `input_tokens` is the whole prompt, `input_tokens_details.cached_tokens` the part served
from the prefix cache; `output_tokens_details.reasoning_tokens` the tokens of the reasoning. A
response with `store` true is kept (talaria/gateway/response_store.py) once it is complete.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from talaria.contracts.call import Usage
from talaria.gateway.errors import APIError
from talaria.gateway.output_parser import CallArguments, CallStart, Event, ParsedOutput, Reasoning
from talaria.gateway.response_store import ResponseStore
from talaria.gateway.responses_input import conversation, seal
from talaria.gateway.responses_protocol import ResponsesRequest


def event(kind: str, payload: dict[str, Any], sequence: int) -> bytes:
    data = json.dumps({"type": kind, **payload, "sequence_number": sequence}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()


def usage_json(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage.completion_tokens)},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


class ResponsesFormat:
    """One Responses call's response, whole or streamed. `new_id` makes fresh ids; `count_tokens`
    counts a text's tokens (the reasoning's, for usage)."""

    def __init__(self, response_id: str, created: int, model: str, request: ResponsesRequest,
                 new_id: Callable[[], str], count_tokens: Callable[[str], int], store: ResponseStore) -> None:
        self._request = request
        self._new_id = new_id
        self._count = count_tokens
        self._store = store
        self._head = {"id": response_id, "object": "response", "created_at": created, "model": model}
        self.items: list[dict[str, Any]] = []  # the output so far, as the client assembles it
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._texts: list[str] = []  # per item: its text (reasoning, message) or arguments so far
        self._reasoning = ""  # every reasoning text, for usage
        self._sequence = 0

    # ---- the response object -----------------------------------------------------------------

    def response(self, status: str, usage: Usage | None = None, *, incomplete: str | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {**self._head, "status": status, "error": error,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                **self._request.echo, "output": [dict(i) for i in self.items],
                "usage": usage_json(usage, self._reasoning_tokens()) if usage is not None else None}
        return body

    def _reasoning_tokens(self) -> int:
        return self._count(self._reasoning) if self._reasoning else 0

    # ---- streamed ----------------------------------------------------------------------------

    def _emit(self, kind: str, payload: dict[str, Any]) -> bytes:
        out = event(kind, payload, self._sequence)
        self._sequence += 1
        return out

    def start(self, prompt_tokens: int) -> bytes:
        snapshot = self.response("in_progress")
        return self._emit("response.created", {"response": snapshot}) + \
            self._emit("response.in_progress", {"response": snapshot})

    def event_chunk(self, e: Event) -> bytes:
        out = b""
        if isinstance(e, CallStart):
            out += self._close("completed")
            return out + self._begin(self._call_item(e.name))
        if isinstance(e, CallArguments):
            self._texts[-1] += e.text
            return self._emit("response.function_call_arguments.delta",
                              {**self._where(), "delta": e.text})
        kind = "reasoning" if isinstance(e, Reasoning) else "message"
        if self._open is None or self._open["type"] != kind:
            out += self._close("completed")
            out += self._begin(self._reasoning_item() if kind == "reasoning" else self._message_item())
        self._texts[-1] += e.text
        if kind == "reasoning":
            self._reasoning += e.text
            if not self._request.summary:
                return out
            return out + self._emit("response.reasoning_summary_text.delta",
                                    {**self._where(), "summary_index": 0, "delta": e.text})
        return out + self._emit("response.output_text.delta",
                                {**self._where(), "content_index": 0, "delta": e.text, "logprobs": []})

    def end(self, finish: str, usage: Usage, stop_sequence: str | None) -> bytes:
        cut = finish == "length"
        out = self._close("incomplete" if cut else "completed")
        body = self._finished(usage, cut)
        return out + self._emit("response.incomplete" if cut else "response.completed", {"response": body})

    def error_chunk(self, error: APIError) -> bytes:
        """In-band, once the headers are sent: an `error` event, then `response.failed`; the stream ends."""
        code = "rate_limit_exceeded" if error.status == 429 else "server_error"
        failed = self.response("failed", error={"code": code, "message": error.message})
        return self._emit("error", {"code": error.code or code, "message": error.message, "param": error.param}) + \
            self._emit("response.failed", {"response": failed})

    def reply_message(self) -> dict[str, Any] | None:
        """The output as the assistant message the client's next request converts it to (session continuity)."""
        turn = conversation(self.items, self._request.namespaces) if self.items else []
        return turn[0] if turn else None

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _begin(self, item: dict[str, Any]) -> bytes:
        self.items.append(item)
        self._texts.append("")
        self._open = item
        out = self._emit("response.output_item.added", {"output_index": len(self.items) - 1, "item": dict(item)})
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._emit("response.content_part.added", {**self._where(), "content_index": 0, "part": part})
        elif item["type"] == "reasoning" and self._request.summary:
            out += self._emit("response.reasoning_summary_part.added",
                              {**self._where(), "summary_index": 0, "part": {"type": "summary_text", "text": ""}})
        return out

    def _close(self, status: str) -> bytes:
        item = self._open
        if item is None:
            return b""
        self._open = None
        text, where, out = self._texts[-1], self._where(), b""
        self._settle(item, text, status)
        if item["type"] == "message":
            out += self._emit("response.output_text.done", {**where, "content_index": 0, "text": text, "logprobs": []})
            out += self._emit("response.content_part.done", {**where, "content_index": 0, "part": item["content"][0]})
        elif item["type"] == "function_call":
            out += self._emit("response.function_call_arguments.done", {**where, "name": item["name"],
                                                                        "arguments": text})
        elif self._request.summary:
            out += self._emit("response.reasoning_summary_text.done", {**where, "summary_index": 0, "text": text})
            out += self._emit("response.reasoning_summary_part.done",
                              {**where, "summary_index": 0, "part": item["summary"][0]})
        return out + self._emit("response.output_item.done", {"output_index": where["output_index"],
                                                              "item": dict(item)})

    def _settle(self, item: dict[str, Any], text: str, status: str) -> None:
        """An item's final fields, once its text is whole."""
        item["status"] = status
        if item["type"] == "message":
            item["content"] = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        elif item["type"] == "function_call":
            item["arguments"] = text
        else:
            item["summary"] = [{"type": "summary_text", "text": text}] if self._request.summary else []
            if self._request.encrypted:
                item["encrypted_content"] = seal(text)

    def _finished(self, usage: Usage, cut: bool) -> dict[str, Any]:
        body = self.response("incomplete" if cut else "completed", usage,
                             incomplete="max_output_tokens" if cut else None)
        if self._request.store:  # kept with its reasoning's text, whatever `include` asked: it renders the same
            kept = tuple({**i, "encrypted_content": seal(text)} if i["type"] == "reasoning" else dict(i)
                         for i, text in zip(self.items, self._texts, strict=True))
            self._store.put(self._request.tenant, self._head["id"], self._request.items, kept, body)
        return body

    # ---- items -------------------------------------------------------------------------------

    def _reasoning_item(self) -> dict[str, Any]:
        return {"id": f"rs_{self._new_id()}", "type": "reasoning", "summary": [], "status": "in_progress"}

    def _message_item(self) -> dict[str, Any]:
        return {"id": f"msg_{self._new_id()}", "type": "message", "status": "in_progress", "role": "assistant",
                "content": []}

    def _call_item(self, name: str) -> dict[str, Any]:
        item = {"id": f"fc_{self._new_id()}", "type": "function_call", "status": "in_progress",
                "call_id": f"call_{self._new_id()}", "name": name, "arguments": ""}
        if name in self._request.namespaces:
            item["namespace"], item["name"] = self._request.namespaces[name]
        return item

    # ---- whole -------------------------------------------------------------------------------

    def whole(self, text: str, parsed: ParsedOutput, finish: str, usage: Usage,
              stop_sequence: str | None) -> dict[str, Any]:
        cut = finish == "length"
        pieces: list[tuple[dict[str, Any], str]] = []
        if parsed.reasoning is not None:
            pieces.append((self._reasoning_item(), parsed.reasoning))
            self._reasoning = parsed.reasoning
        if parsed.content:
            pieces.append((self._message_item(), parsed.content))
        pieces += [(self._call_item(name), arguments) for name, arguments in parsed.tool_calls]
        for k, (item, piece) in enumerate(pieces):
            self._settle(item, piece, "incomplete" if cut and k == len(pieces) - 1 else "completed")
            self.items.append(item)
            self._texts.append(piece)
        return self._finished(usage, cut)
