"""Typed reads from a request's JSON object, each bad value a 400 that names the field."""

from __future__ import annotations

import math
from typing import Any

from talaria.gateway.errors import APIError


class Fields:
    """Typed reads from a JSON object; each bad value becomes a 400 naming the field.

    JSON booleans are Python ints, so every numeric reader rejects bool explicitly.
    """

    def __init__(self, data: dict[str, Any], prefix: str = "") -> None:
        self._data = data
        self._prefix = prefix

    def get(self, name: str) -> Any:
        return self._data.get(name)

    def _bad(self, name: str, what: str) -> APIError:
        return APIError.invalid(f"{self._prefix}{name} must be {what}", self._prefix + name)

    def string(self, name: str, required: bool = False) -> str | None:
        value = self._data.get(name)
        if value is None and not required:
            return None
        if not isinstance(value, str) or not value:
            raise self._bad(name, "a non-empty string")
        return value

    def object(self, name: str) -> dict[str, Any] | None:
        value = self._data.get(name)
        if value is not None and not isinstance(value, dict):
            raise self._bad(name, "an object")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self._data.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(name, "a boolean")
        return value

    def integer(self, name: str, minimum: int | None = None, maximum: int | None = None) -> int | None:
        value = self._data.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(name, "an integer")
        if maximum is not None and (value > maximum or (minimum is not None and value < minimum)):
            raise self._bad(name, f"an integer in [{minimum}, {maximum}]")
        if minimum is not None and value < minimum:
            raise self._bad(name, f"an integer >= {minimum}")
        return value

    def number(self, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
        value = self._data.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._bad(name, "a finite number")
        if value > high or value < low or (low_open and value == low):
            raise self._bad(name, f"in {'(' if low_open else '['}{low:g}, {high:g}]")
        return float(value)

    def int_list(self, name: str, minimum: int, below: int, most: int | None = None) -> tuple[int, ...]:
        value = self._data.get(name)
        if value is None:
            return ()
        if not isinstance(value, list) or (most is not None and len(value) > most) or not all(
            isinstance(v, int) and not isinstance(v, bool) and minimum <= v < below for v in value
        ):
            at_most = f"at most {most} " if most is not None else ""
            raise self._bad(name, f"an array of {at_most}token ids in [{minimum}, {below})")
        return tuple(value)
