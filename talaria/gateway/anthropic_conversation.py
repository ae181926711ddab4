"""A Messages API conversation in the chat shape the rest of the gateway speaks.

The Messages API writes a conversation as turns of content blocks; talaria/gateway/chat_prompt.py
takes OpenAI's shape (roles, string content, assistant `tool_calls`, `tool` messages). Each turn
converts on its own, so a conversation that grows by appending turns converts to messages that
grow by appending too, and its prompt stays an extension of the last one (the prefix the instance
cached). The rules, all in docs/api.md:
- `user`: `text` blocks joined by newlines; `tool_result` blocks become `tool` messages (their
  content a string or `text` and `tool_reference` blocks; `is_error` shown as `Error: ...`).
- `assistant`: `text`, and `tool_use` as `tool_calls` (input as JSON text). Its `thinking` blocks
  are shown only in the turns the request's `clear_thinking` edit keeps (`BlockRules.keep_thinking`),
  as the message's `reasoning_content` (the field reasoning models' templates read); without the
  edit none are. `redacted_thinking` is opaque and never shown.
- `system` turns (Claude Code's environment block, instructions given mid-conversation) become
  system messages where they stand; chat_prompt decides how a template that takes one system
  message only shows them. `clear_at: "next_user_message"` hides one once a later user turn exists.
- Deferred tools (`defer_loading`) are not in the template's tool list. Where the conversation
  loads one — a `tool_reference` block in a `tool_result` (what a tool search returns) or a system
  turn's `tool_addition` — the tool's definition is written in the text (`definition_text`), so
  loading a tool appends to the prompt rather than changing its start. `tool_removal` writes a line
  saying the tool is no longer available.
- Anything else is a 400 that names the block: images and documents (text-only models), server
  tool blocks (Talaria runs no server tools), and types it does not know.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from talaria.gateway.errors import APIError
from talaria.gateway.fields import Fields
from talaria.gateway.tools import definition_text

ROLES = ("user", "assistant", "system")
UNSUPPORTED_BLOCKS = ("image", "document", "search_result")  # Talaria serves text-only models
SERVER_BLOCKS = ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
                 "bash_code_execution_tool_result", "text_editor_code_execution_tool_result",
                 "tool_search_tool_result", "advisor_tool_result", "mcp_tool_use", "mcp_tool_result",
                 "mcp_tool_listing", "container_upload")
BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
          "system": ("text", "tool_addition", "tool_removal")}  # what each role's turn may hold
CLEAR_AT = ("never", "next_user_message")


@dataclass(frozen=True, slots=True)
class BlockRules:
    """What converting a request's turns needs to know beyond the turns themselves."""

    definitions: Mapping[str, dict[str, Any]] = field(default_factory=dict)  # declared tools by name (template shape)
    keep_thinking: int | None = 0  # the latest assistant turns with thinking whose thinking is shown (None: all)


def conversation(messages: Any, rules: BlockRules) -> list[dict[str, Any]]:
    """The request's `messages` in chat shape; raises APIError 400 naming what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise APIError.invalid("messages must be a non-empty array", "messages")
    turns = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise APIError.invalid(f'{where}.role must be "user", "assistant" or "system"', f"{where}.role")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise APIError.invalid(f"{where}.content must be a string or an array of content blocks",
                                   f"{where}.content")
        turns.append((role, blocks, where, m))
    thinking = [i for i, (role, blocks, _, _) in enumerate(turns) if role == "assistant"
                and any(isinstance(b, dict) and b.get("type") == "thinking" for b in blocks)]
    keep = rules.keep_thinking
    shown = set(thinking if keep is None else thinking[-keep:] if keep else ())
    last_user = max((i for i, (role, *_) in enumerate(turns) if role == "user"), default=-1)
    out: list[dict[str, Any]] = []
    for i, (role, blocks, where, m) in enumerate(turns):
        if role == "system":
            out += _system_turn(m, blocks, where, rules, i < last_user)
        else:
            out += _turn(role, blocks, where, rules, i in shown)
    return out


def assistant_turn(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's content blocks in chat shape, as its next request will convert them
    (its thinking not shown: what a request without a `clear_thinking` edit makes of it)."""
    return _turn("assistant", blocks, "content", BlockRules(), False)


def text_block(block: Any, where: str) -> str:
    if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
        return block["text"]
    raise APIError.invalid(f"{where} must be a text block {{\"type\": \"text\", \"text\": ...}}", where)


def _turn(role: str, blocks: list[Any], where: str, rules: BlockRules, show_thinking: bool) -> list[dict[str, Any]]:
    texts, calls, results, reasoning = [], [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _kind(block, role, at)
        if kind == "text":
            texts.append(text_block(block, at))
        elif kind == "tool_use":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                    and isinstance(block.get("input"), dict)):
                raise APIError.invalid(f"{at}: a tool_use block needs an id, a name and an input object", at)
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        elif kind == "tool_result":
            results.append(_tool_result(block, at, rules))
        elif kind == "thinking" and show_thinking and isinstance(block.get("thinking"), str) and block["thinking"]:
            reasoning.append(block["thinking"])
        # thinking not shown, and redacted_thinking (opaque): not written into the prompt
    out = results
    if role == "assistant":
        if texts or calls:
            message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) or None}
            if calls:
                message["tool_calls"] = calls
            if reasoning:
                message["reasoning_content"] = "\n".join(reasoning)
            out.append(message)
    elif texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _kind(block: Any, role: str, at: str) -> str:
    """The block's type if a `role` turn may hold it; else a 400 that says why not."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in BLOCKS[role]:
        return kind
    if kind in UNSUPPORTED_BLOCKS:
        raise APIError.invalid(f"{at}: {kind} blocks are not supported: Talaria serves text-only models; "
                               "send text blocks", at)
    if kind in SERVER_BLOCKS:
        raise APIError.invalid(f"{at}: {kind} blocks are not supported: they belong to server tools, which "
                               "Talaria does not run", at)
    if any(kind in kinds for kinds in BLOCKS.values()):
        raise APIError.invalid(f"{at}: a {kind!r} block is not supported in a {role} message", at)
    raise APIError.invalid(f"{at}: unknown content block type {kind!r}; a {role} message takes "
                           f"{', '.join(BLOCKS[role])} blocks", at)


def _tool_result(block: dict[str, Any], at: str, rules: BlockRules) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise APIError.invalid(f"{at}: a tool_result block needs the tool_use_id it answers", at)
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_result_part(b, f"{at}.content[{k}]", rules) for k, b in enumerate(content))
    elif not isinstance(content, str):
        raise APIError.invalid(f"{at}.content must be a string or an array of text blocks", f"{at}.content")
    if Fields(block, f"{at}.").boolean("is_error", False):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _result_part(part: Any, at: str, rules: BlockRules) -> str:
    """A tool result's block as text: its text, or the definition of the tool a tool search loaded."""
    if isinstance(part, dict) and part.get("type") == "tool_reference":
        return _definition(part.get("tool_name"), at, rules)
    if isinstance(part, dict) and part.get("type") in UNSUPPORTED_BLOCKS:
        raise APIError.invalid(f"{at}: {part['type']} blocks are not supported: Talaria serves text-only models; "
                               "send text blocks", at)
    return text_block(part, at)


def _definition(name: Any, at: str, rules: BlockRules) -> str:
    if not isinstance(name, str) or name not in rules.definitions:
        raise APIError.invalid(f"{at} names the tool {name!r}, which is not among the request's tools; a tool "
                               "is loaded mid-conversation by declaring it in tools with defer_loading: true", at)
    return definition_text(rules.definitions[name])


def _system_turn(message: dict[str, Any], blocks: list[Any], where: str, rules: BlockRules,
                 user_after: bool) -> list[dict[str, Any]]:
    clear_at = message.get("clear_at")
    if clear_at is not None and clear_at not in CLEAR_AT:
        raise APIError.invalid(f'{where}.clear_at must be "never" or "next_user_message"', f"{where}.clear_at")
    texts = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _kind(block, "system", at)
        if kind == "text":
            texts.append(text_block(block, at))
            continue
        tool = block.get("tool")
        if not (isinstance(tool, dict) and tool.get("type") == "tool_reference"):
            kind_of = tool.get("type") if isinstance(tool, dict) else None
            raise APIError.invalid(f'{at}.tool must be {{"type": "tool_reference", "name": ...}}, a tool declared '
                                   f"in tools (not {kind_of!r}: Talaria has no MCP client and no inline tools)",
                                   f"{at}.tool")
        definition = _definition(tool.get("name"), f"{at}.tool", rules)
        texts.append(definition if kind == "tool_addition" else f"The tool {tool['name']} is no longer available.")
    if clear_at == "next_user_message" and user_after:
        return []  # shown only for the user turn it follows
    return [{"role": "system", "content": "\n\n".join(texts)}] if texts else []
