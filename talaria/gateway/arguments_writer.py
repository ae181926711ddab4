"""A tool call's arguments as the text of a JSON object, built from raw parameter values typed by
the tool's schema: the half that the tag formats share (Qwen3-Coder's `<parameter=P>`, read by
talaria/gateway/xml_call_parser.py; GLM's `<arg_key>`/`<arg_value>`, read by
talaria/gateway/glm_call_parser.py).

These formats write a value as raw text, with no type of its own (their chat templates render an
earlier call's string values as they are and other values as JSON), so the type comes from the
request's `tools`, by one rule for every format:
- a JSON string when the parameter's schema allows `"string"` (`type`, a list of types, or an
  `anyOf`/`oneOf` member's), and when there is no type to go by: an unknown function or parameter,
  a schema without `type`. Never guessed from the text (`"007"`, `"true"`, `"{}"` may be strings);
- otherwise the value parsed as JSON (`3`, `2.5`, `true`, `null`, `{"a": [1]}`), or `True`/`False`
  for a boolean and `None` for a null as Qwen3.5's template renders them (Python's `str`); a value
  that is none of these stays the string it was written as (never NaN or Infinity, which JSON lacks).
A string value is written piece by piece as it arrives (escaping is per character, so pieces
concatenate); a typed one whole, once its closing tag comes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from talaria.gateway.output_events import CallArguments, CallStart, Event


class ArgumentsWriter:
    """The events of one parser's calls, one call at a time: `open` it, then per parameter its
    `key`, the `piece`s of a string value and the value's `end`, then `close` it. The parser owns
    the syntax (where a call or a value begins and ends); this owns the JSON and the types."""

    def __init__(self, schemas: Mapping[str, Any] | None = None) -> None:
        self._schemas = schemas or {}  # function name -> its parameters' JSON schema
        self._calls = 0  # calls opened; the current one is the last
        self._properties: Mapping[str, Any] = {}  # the current function's parameter schemas
        self._params = 0  # parameters written in the current call
        self._types: frozenset[str] = frozenset()  # the current value's schema types

    def open(self, name: str) -> list[Event]:
        schema = self._schemas.get(name)
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        self._properties = properties if isinstance(properties, Mapping) else {}
        self._params = 0
        self._calls += 1
        return [CallStart(self._calls - 1, name), CallArguments(self._calls - 1, "{")]

    def key(self, name: str) -> Event:
        """A parameter's key, and the opening quote when its value is a string."""
        self._types = value_types(self._properties.get(name))
        key = json.dumps(name, ensure_ascii=False) + ": " + ('"' if self.is_string else "")
        self._params += 1
        return self._event((", " if self._params > 1 else "") + key)

    @property
    def is_string(self) -> bool:
        """The current value is written as a JSON string (so it may be streamed)."""
        return not self._types or "string" in self._types

    def piece(self, text: str) -> Event:
        """The next piece of a string value."""
        return self._event(escaped(text))

    def end(self, text: str) -> Event:
        """The rest of the current value (all of it, for a typed one), then what closes it."""
        if self.is_string:
            return self._event(escaped(text) + '"')
        return self._event(json.dumps(typed_value(text, self._types), ensure_ascii=False))

    def close(self) -> Event:
        return self._event("}")

    def _event(self, text: str) -> Event:
        return CallArguments(self._calls - 1, text)


def value_types(schema: Any) -> frozenset[str]:
    """The JSON types a parameter's schema names: `type` (one or a list) and its `anyOf`/`oneOf`
    members' `type`; empty when it names none."""
    if not isinstance(schema, Mapping):
        return frozenset()
    schemas = [schema]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            schemas += [m for m in schema[key] if isinstance(m, Mapping)]
    found: set[str] = set()
    for s in schemas:
        t = s.get("type")
        if isinstance(t, str):
            found.add(t)
        elif isinstance(t, list):
            found.update(x for x in t if isinstance(x, str))
    return frozenset(found)


def typed_value(text: str, types: frozenset[str]) -> Any:
    """A value whose schema does not allow a string: its JSON, or the string it was written as."""
    try:
        return json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except (ValueError, RecursionError):
        pass
    word = text.strip()
    if "boolean" in types and word in ("True", "False"):
        return word == "True"
    if "null" in types and word == "None":
        return None
    return text


def escaped(text: str) -> str:
    """`text` as the inside of a JSON string (escaping is per character, so pieces concatenate)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400
        raise ValueError(f"{text} is not a finite number")
    return value
