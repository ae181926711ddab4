"""A Responses API conversation (`input` items) and its tools in the chat shape the gateway speaks.

The Responses API writes a conversation as a list of items; talaria/gateway/chat_prompt.py takes
OpenAI's chat shape. As for the Messages API (talaria/gateway/anthropic_conversation.py), each item
converts on its own and in order, so an agent's next request — its last request's items, the items
it got back, and its new ones — converts to messages that extend its last request's messages, and
its prompt stays an extension of the last one. The rules, all in docs/api.md:
- `message` items (`type` may be left out): roles `user`, `system`, `developer` (as `system`) and
  `assistant`; `content` a string or `input_text` / `output_text` / `text` (and an assistant's
  `refusal`) parts, joined by newlines. Images, files and audio are refused (text-only models).
- The assistant side of one turn — its `reasoning` item, its `message` and its `function_call`s, in
  the order a response lists them — is one assistant message: `content`, `tool_calls` (arguments as
  the JSON text they came in) and `reasoning_content`. A reasoning item's text is read back from its
  `encrypted_content` (Talaria's own: the exact text the model wrote, so the turn renders into the
  same tokens), else from its `content` (`reasoning_text` parts), else its summary's texts (so
  another server's `encrypted_content`, which cannot be read here, falls back to the summary).
- `function_call_output` becomes a `tool` message answering its `call_id`.
- Functions of a `namespace` tool are offered to the model under one name each (`offered_name`), and
  a `function_call` item carrying a `namespace` is read under that name; so are the response's calls
  written back (`Namespaces`).
- Any other item type is a 400 naming it: Talaria runs no hosted tools, so their calls and outputs
  (`web_search_call`, `computer_call`, ...) never come from it, and `item_reference` needs items
  stored server-side (`previous_response_id` carries them instead).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from talaria.gateway.errors import APIError

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio", "image_url")  # Talaria serves text-only models
SEALED = b"talaria-reasoning-v1:"  # what Talaria's encrypted_content starts with, once base64-decoded

Namespaces = Mapping[str, tuple[str, str]]  # offered name -> (namespace, the function's own name)


def offered_name(namespace: str, name: str) -> str:
    """The name a namespace's function is offered under: `<namespace>__<name>`, or `<namespace><name>`
    when the namespace already ends with `_` (an MCP-style `mcp__github__`)."""
    return f"{namespace}{name}" if namespace.endswith("_") else f"{namespace}__{name}"


def seal(reasoning: str) -> str:
    """A reasoning text as an opaque `encrypted_content`: it round-trips exactly. Not encrypted —
    the client holds its own model's reasoning — but opaque, and checked when it comes back."""
    return base64.b64encode(SEALED + reasoning.encode()).decode()


def unseal(content: str) -> str | None:
    """The reasoning text of Talaria's own `encrypted_content`; None for another server's (OpenAI's
    cannot be read here: the turn then renders from the item's summary)."""
    try:
        raw = base64.b64decode(content, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw[len(SEALED):].decode(errors="replace") if raw.startswith(SEALED) else None


def conversation(items: list[Any], namespaces: Namespaces, first: int = 0) -> list[dict[str, Any]]:
    """`items` in chat shape; raises APIError 400 naming the item at fault (numbered from `first`)."""
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being put together
    by_name = {v: k for k, v in namespaces.items()}
    for i, item in enumerate(items, first):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError.invalid(f"{where} must be an item object", where)
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") != "assistant":
            turn = _flush(turn, out)
            out.append({"role": _role(item, where), "content": _text(item.get("content"), where)})
        elif kind == "message":
            if turn is not None and (turn.get("tool_calls") or turn["content"] is not None):
                turn = _flush(turn, out)
            turn = turn or _assistant()
            text = _text(item.get("content"), where)
            turn["content"] = text if turn["content"] is None else f"{turn['content']}\n{text}"
        elif kind == "reasoning":
            if turn is not None and (turn["content"] is not None or {"tool_calls", "reasoning_content"} & turn.keys()):
                turn = _flush(turn, out)  # a turn's reasoning comes first: this one opens the next turn
            turn = turn or _assistant()
            turn["reasoning_content"] = _reasoning(item, where)
        elif kind == "function_call":
            turn = turn or _assistant()
            turn.setdefault("tool_calls", []).append(_call(item, where, by_name))
        elif kind == "function_call_output":
            turn = _flush(turn, out)
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": _output(item.get("output"), where)})
        else:
            raise APIError.invalid(f"{where}: {kind!r} items are not supported: Talaria runs no hosted tools and "
                                   "stores no items to reference; send message, function_call, "
                                   "function_call_output and reasoning items", f"{where}.type")
    _flush(turn, out)
    return out


def _assistant() -> dict[str, Any]:
    return {"role": "assistant", "content": None}


def _flush(turn: dict[str, Any] | None, out: list[dict[str, Any]]) -> None:
    if turn is not None:
        if turn["content"] is None and not turn.get("tool_calls"):
            turn["content"] = ""  # a turn that only reasoned (cut short by max_output_tokens)
        out.append(turn)
    return None


def _role(item: dict[str, Any], where: str) -> str:
    role = item.get("role")
    if role not in ROLES:
        raise APIError.invalid(f'{where}.role must be "user", "system", "developer" or "assistant"', f"{where}.role")
    return ROLES[role]


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError.invalid(f"{where}.content must be a string or an array of content parts", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in UNSUPPORTED_PARTS:
            raise APIError.invalid(f"{at}: {kind} parts are not supported: Talaria serves text-only models; "
                                   "send input_text parts", at)
        else:
            raise APIError.invalid(f"{at}: unknown content part {kind!r}; send input_text parts", at)
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError.invalid(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def _call(item: dict[str, Any], where: str, by_name: Mapping[tuple[str, str], str]) -> dict[str, Any]:
    name = _string(item, "name", where)
    namespace = item.get("namespace")
    if namespace is not None:
        if not isinstance(namespace, str):
            raise APIError.invalid(f"{where}.namespace must be a string", f"{where}.namespace")
        name = by_name.get((namespace, name)) or offered_name(namespace, name)
    return {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": name, "arguments": _string(item, "arguments", where)}}


def _output(output: Any, where: str) -> str:
    """A function's output: a string, or text parts (joined by newlines)."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _text(output, f"{where}.output")
    raise APIError.invalid(f"{where}.output must be a string or an array of input_text parts", f"{where}.output")


def _reasoning(item: dict[str, Any], where: str) -> str:
    sealed = item.get("encrypted_content")
    text = unseal(sealed) if isinstance(sealed, str) else None
    if text is not None:
        return text
    content = item.get("content")
    if isinstance(content, list) and content:
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "reasoning_text")
    summary = item.get("summary")
    if summary is None:
        return ""
    if not isinstance(summary, list):
        raise APIError.invalid(f"{where}.summary must be an array of summary_text parts", f"{where}.summary")
    return "\n\n".join(p["text"] for p in summary if isinstance(p, dict) and isinstance(p.get("text"), str))
