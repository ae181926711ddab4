"""Tools in a Chat Completions request: what the client offers, what it forces, and how the model
sees them.

`parse_tools` validates `tools`, `tool_choice` and `parallel_tool_calls` (OpenAI's shapes). A
model's formats come from its config or, with `auto`, from its chat template (`model_formats`): a
template that renders calls as `<function=...>` with `<parameter=...>` blocks (Qwen3-Coder, Qwen3.5)
writes the XML format; one that renders `<arg_key>` (GLM-4.5 to GLM-5) GLM's format; Llama 3's (an
`ipython` role) the Llama-3 JSON format; every other one the Hermes format. `template_messages`
prepares a conversation for the template:
- a template that takes `tools` gets them, and assistant tool calls with their arguments as objects,
  as Hugging Face templates expect;
- a template without a tool section (SmolLM2's) gets the **default rendering**, in the Hermes format:
  the tools described in the system message within `<tools></tools>`, each earlier assistant call
  written as `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, and tool results as a
  user turn of `<tool_response>\\n...\\n</tool_response>` blocks (Qwen2.5's rendering, whose format
  the output parser reads back).
Deferred tools (the Messages API's `defer_loading`) are never among the tools a template lists: a
tool that loads mid-conversation would otherwise change the system prompt and so every cached
prefix. The conversation shows each one where it is referenced instead (`definition_text`, as the
Messages API's blocks are converted: talaria/gateway/anthropic_conversation.py); its calls are
parsed like any other tool's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from talaria.config.schema import ModelConfig, ReasoningParser, ToolParser
from talaria.gateway.errors import APIError
from talaria.gateway.fields import Fields

if TYPE_CHECKING:
    from talaria.models.tokenizer import Tokenizer

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
DEFAULT_SYSTEM = "You are a helpful assistant."
TOOLS_PREAMBLE = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_INSTRUCTION = ("</tools>\n\nFor each function call, return a json object with function name and arguments "
                     "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                     '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


class ToolChoice(str, Enum):
    AUTO = "auto"  # the model decides; its calls are parsed out of its output
    NONE = "none"  # no calls: the tools are not shown and nothing is parsed
    REQUIRED = "required"  # at least one call, decoding constrained to the tools' schemas
    NAMED = "function"  # this one function, constrained


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema for the arguments object


@dataclass(frozen=True, slots=True)
class Tools:
    """The tools of one request."""

    functions: tuple[Function, ...]
    choice: ToolChoice
    named: str | None  # the function a named tool_choice forces
    parallel: bool  # parallel_tool_calls: the model may make several calls in one turn
    definitions: tuple[dict[str, Any], ...]  # {"type": "function", "function": {...}} as the template takes them
    deferred: frozenset[str] = frozenset()  # functions not listed to the template (shown where referenced)

    @property
    def forced(self) -> tuple[Function, ...]:
        """The functions decoding is constrained to ((): not constrained)."""
        if self.choice is ToolChoice.REQUIRED:
            return self.functions
        if self.choice is ToolChoice.NAMED:
            return tuple(f for f in self.functions if f.name == self.named)
        return ()


def parse_tools(f: Fields) -> Tools | None:
    """The request's tools, or None when it offers none."""
    raw, choice = f.get("tools"), f.get("tool_choice")
    parallel = f.boolean("parallel_tool_calls", True)
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise APIError.invalid("tool_choice forces a tool but the request has no tools", "tool_choice")
        return None
    if not isinstance(raw, list):
        raise APIError.invalid("tools must be an array of {\"type\": \"function\", \"function\": {...}}", "tools")
    functions, definitions = [], []
    for i, tool in enumerate(raw):
        fn, where = _function(tool, i)
        if fn.name in (g.name for g in functions):
            raise APIError.invalid(f"{where}.name {fn.name!r} is defined twice; function names must be unique",
                                   f"{where}.name")
        functions.append(fn)
        body = {"name": fn.name, "parameters": fn.parameters}
        if fn.description is not None:
            body["description"] = fn.description
        definitions.append({"type": "function", "function": body})
    named = None
    if choice is None or choice == "auto":
        kind = ToolChoice.AUTO
    elif choice in ("none", "required"):
        kind = ToolChoice(choice)
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        named, kind = choice["function"].get("name"), ToolChoice.NAMED
        if named not in {fn.name for fn in functions}:
            raise APIError.invalid(f"tool_choice names function {named!r}, which is not among the tools "
                                   f"({', '.join(fn.name for fn in functions)})", "tool_choice")
    else:
        raise APIError.invalid('tool_choice must be "auto", "none", "required" or '
                               '{"type": "function", "function": {"name": ...}}', "tool_choice")
    return Tools(tuple(functions), kind, named, parallel, tuple(definitions))


def _function(tool: Any, i: int) -> tuple[Function, str]:
    where = f"tools[{i}].function"
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)):
        raise APIError.invalid(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                               f"tools[{i}]")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise APIError.invalid(f"{where}.name must be 1 to 64 letters, digits, _ or -", f"{where}.name")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise APIError.invalid(f"{where}.description must be a string", f"{where}.description")
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise APIError.invalid(f"{where}.parameters must be a JSON schema object", f"{where}.parameters")
    return Function(name, description, parameters), where


@dataclass(frozen=True, slots=True)
class ModelFormats:
    """How one model writes tool calls and reasoning, and whether its template renders tools."""

    tools: ToolParser | None  # HERMES, LLAMA3_JSON, QWEN3_CODER or GLM; None: the model does no tool calling
    reasoning: bool  # its output starts with <think>...</think>
    template_tools: bool  # its chat template takes `tools` (else: the default Hermes rendering)


def model_formats(config: ModelConfig, tokenizer: Tokenizer) -> ModelFormats:
    """The model's formats: as configured, or detected from its chat template."""
    source = tokenizer.chat_template_source or ""
    tools = config.tool_parser
    if tools is ToolParser.AUTO:
        if "<function=" in source and "<parameter=" in source:  # Qwen3-Coder's and Qwen3.5's calls
            tools = ToolParser.QWEN3_CODER
        elif "<arg_key>" in source:  # GLM's calls: the name, then <arg_key>/<arg_value> pairs
            tools = ToolParser.GLM
        elif "<|python_tag|>" in source or "ipython" in source:
            tools = ToolParser.LLAMA3_JSON
        else:
            tools = ToolParser.HERMES
    reasoning = config.reasoning_parser
    if reasoning is ReasoningParser.AUTO:
        reasoning = ReasoningParser.THINK if "<think>" in source else ReasoningParser.NONE
    return ModelFormats(None if tools is ToolParser.NONE else tools, reasoning is ReasoningParser.THINK,
                        "tools" in source)


def template_messages(messages: list[dict[str, Any]], tools: Tools | None,
                      formats: ModelFormats) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) as the model's chat template takes them; deferred tools are not listed."""
    offered = None
    if tools is not None and tools.choice is not ToolChoice.NONE:
        offered = [d for d in tools.definitions if d["function"]["name"] not in tools.deferred]
    if formats.template_tools:
        return [_with_argument_objects(m) for m in messages], offered or None
    return _default_rendering(messages, offered), None


def definition_text(definition: dict[str, Any]) -> str:
    """A tool's definition as text in the conversation, where a deferred tool is loaded: one JSON
    line within `<tools></tools>`, as the default rendering and most templates list tools."""
    return f"<tools>\n{json.dumps(definition, ensure_ascii=False)}\n</tools>"


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        fn = dict(call.get("function") or {})
        fn["arguments"] = _arguments(fn.get("arguments"))
        out.append({**call, "function": fn})
    return {**message, "tool_calls": out}


def _arguments(value: Any) -> Any:
    """A call's arguments as an object when they are a JSON object's text, else as they are."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _default_rendering(messages: list[dict[str, Any]], offered: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        if role == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if role == "assistant" and m.get("tool_calls"):
            calls = [json.dumps({"name": (c.get("function") or {}).get("name"),
                                 "arguments": _arguments((c.get("function") or {}).get("arguments"))},
                                ensure_ascii=False) for c in m["tool_calls"]]
            text = "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)
            out.append({"role": "assistant", "content": (m.get("content") or "") + ("\n" if m.get("content") else "")
                        + text, **_reasoning(m)})
            continue
        out.append({"role": role, "content": m.get("content") or "", **_reasoning(m)})
    for m in out:
        m.pop("_tool_results", None)
    if offered is not None:  # even with every tool deferred: the call format is known before one loads
        described = "\n".join(json.dumps(t, ensure_ascii=False) for t in offered)
        preamble = f"{TOOLS_PREAMBLE}\n{described}\n{TOOLS_INSTRUCTION}"
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{preamble}"}
        else:
            out.insert(0, {"role": "system", "content": f"{DEFAULT_SYSTEM}\n\n{preamble}"})
    return out


def _reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's shown reasoning, kept for a template that reads `reasoning_content`."""
    return {"reasoning_content": message["reasoning_content"]} if message.get("reasoning_content") else {}
