"""Grammars for constrained decoding: forced tool calls and JSON response formats.

A request that forces its output — `tool_choice` "required" or a named function, `response_format`
`json_object` or `json_schema` — carries a grammar to the instance (`SamplingParams.grammar`), and
rank 0 masks every token the grammar does not allow (talaria/executor/grammar_masks.py). Grammars are
llguidance's (the engine vLLM and SGLang offer beside XGrammar): Lark rules, with `%json` for a JSON
schema. It needs neither torch nor transformers, so the gateway builds and validates grammars and only
the sampler compiles them against the vocabulary.

Tool calls are written in the model's own format, so the output parser reads them back
(talaria/gateway/output_parser.py): the wrapper (`<tool_call>\\n{"name": "f", "arguments": ` ...
`}\\n</tool_call>`, or Llama 3's `{"name": "f", "parameters": ` ... `}`) is literal text, and only
the arguments are generated, under the function's parameter schema as a JSON document of its own
(so its `$ref`s resolve as written). JSON is compact: no whitespace beyond `", "` and `": "`, so a
small model cannot wander into unbounded indentation. When the grammar is complete the model may
only end its turn.
"""

from __future__ import annotations

import json
from functools import lru_cache

from llguidance import LLMatcher

from talaria.config.schema import ToolParser
from talaria.gateway.errors import APIError
from talaria.gateway.fields import Fields
from talaria.gateway.tools import Function

COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_call_grammar(fmt: ToolParser, functions: tuple[Function, ...], parallel: bool) -> str:
    """One call of one of `functions` (several, separated as the format separates them, when
    `parallel`), in the model's tool-call format."""
    if fmt in (ToolParser.QWEN3_CODER, ToolParser.GLM):  # raw values between tags, typed by the schema
        raise APIError.invalid("a forced tool_choice cannot be enforced for this model: its tool calls are "
                               f"written as tagged raw values (tool_parser \"{fmt.value}\"), which Talaria "
                               "does not constrain yet; send tool_choice \"auto\"", "tool_choice")
    key = "arguments" if fmt is ToolParser.HERMES else "parameters"
    rules, names = [], []
    for i, fn in enumerate(functions):
        head = "{" + json.dumps("name") + ": " + json.dumps(fn.name) + ", " + json.dumps(key) + ": "
        rules.append(f"call_{i}: {_literal(head)} args_{i} \"}}\"")
        rules.append(f"args_{i}: %json {json.dumps({**fn.parameters, 'x-guidance': COMPACT})}")
        names.append(f"call_{i}")
    one = " | ".join(names)
    if fmt is ToolParser.HERMES:
        body = f'call: "<tool_call>\\n" ({one}) "\\n</tool_call>"'
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
    else:
        body = f"call: {one}"
        start = 'start: call ("; " call)*' if parallel else "start: call"
    return _checked("\n".join([start, body, *rules]), "tools")


def response_format_grammar(f: Fields) -> str | None:
    """The grammar `response_format` asks for; None for text."""
    fmt = f.get("response_format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return _checked(f"start: %json {json.dumps({'type': 'object', 'x-guidance': COMPACT})}", "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError.invalid("response_format.json_schema.schema must be a JSON schema object",
                                   "response_format.json_schema.schema")
        return _checked(f"start: %json {json.dumps({**schema, 'x-guidance': COMPACT})}", "response_format")
    raise APIError.invalid('response_format.type must be "text", "json_object" or "json_schema"',
                           "response_format.type")


def _literal(text: str) -> str:
    """`text` as a Lark string literal (JSON's escaping is Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _checked(lark: str, param: str) -> str:
    grammar, error = _compile(lark)
    if error:
        raise APIError.invalid(f"{param} cannot be enforced: {error}", param)
    return grammar


@lru_cache(maxsize=512)
def _compile(lark: str) -> tuple[str, str]:
    """(llguidance grammar, error or ""): validated once per distinct tool set or schema."""
    grammar = LLMatcher.grammar_from_lark(lark)
    return grammar, LLMatcher.validate_grammar(grammar)
