"""Scanning a model's JSON as it is written, without parsing it: whether a tool call's head is
complete, and where a value ends. The output parser (talaria/gateway/output_parser.py) uses these
to stream calls piece by piece; they never need the whole text.
"""

from __future__ import annotations

import json

WHITESPACE = " \t\n\r"
PARTIAL = object()  # "not yet": the text so far could still become a match


HEAD = ('{', '"name"', ':', None, ',', ('"arguments"', '"parameters"'), ':')  # None: a JSON string


def match_head(text: str) -> tuple[str, int] | object | None:
    """Match `{"name": "N", "arguments": ` (whitespace allowed between the parts) at the start of
    `text`: (N, the offset of the arguments value), PARTIAL if `text` could still become that, or
    None if it cannot."""
    i, name = 0, None
    for part in HEAD:
        while i < len(text) and text[i] in WHITESPACE:
            i += 1
        if i == len(text):
            return PARTIAL
        if part is None:
            end = string_end(text, i)
            if end is None:
                return None
            if end is PARTIAL:
                return PARTIAL
            try:
                name = json.loads(text[i:end])
            except ValueError:
                return None
            i = end
            continue
        options = part if isinstance(part, tuple) else (part,)
        for literal in options:
            if text.startswith(literal, i):
                i += len(literal)
                break
        else:
            tail = text[i:]
            return PARTIAL if any(lit.startswith(tail) for lit in options) else None
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    if i == len(text):
        return PARTIAL  # the value has not begun: wait, so the arguments start with it
    return name, i


def string_end(text: str, i: int):
    """The end (exclusive) of the JSON string starting at text[i]; PARTIAL if unfinished; None if
    text[i] does not start one."""
    if text[i] != '"':
        return None
    j, escaped = i + 1, False
    while j < len(text):
        c = text[j]
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == '"':
            return j + 1
        elif c in "\n\r":
            return None  # raw newlines do not occur in a JSON string
        j += 1
    return PARTIAL


class ValueScanner:
    """Finds where a JSON value ends, piece by piece, without parsing it: bracket depth, strings with
    escapes, and bare scalars (numbers, true/false/null) that end at a delimiter. `depth=1` scans the
    rest of an object already entered, up to its closing brace. `close`: a tag that, outside a
    string, ends the value early (`closed`); a piece that may be the start of it is held back."""

    __slots__ = ("_bare", "_close", "_depth", "_escaped", "_in_string", "_started", "closed", "done")

    def __init__(self, depth: int = 0, close: str | None = None) -> None:
        self._depth = depth
        self._close = close
        self._in_string = self._escaped = self._bare = False
        self._started = depth > 0
        self.done = self.closed = False

    def scan(self, text: str, final: bool = False) -> int:
        """Consume from `text` up to the end of the value; how many characters belong to it."""
        close = self._close
        for i, c in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 0:
                        self.done = True
                        return i + 1
                continue
            if close is not None and c == close[0]:
                if text.startswith(close, i):
                    self.closed = True
                    return i
                if not final and close.startswith(text[i:]):
                    return i  # maybe the tag: hold it back
            if self._bare:
                if c in ",}]" or c in WHITESPACE:
                    self.done = True
                    return i
                continue
            if c == '"':
                self._in_string, self._started = True, True
            elif c in "{[":
                self._depth += 1
                self._started = True
            elif c in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self.done = True
                    return i + 1
            elif not self._started and c not in WHITESPACE:
                self._bare = self._started = True
        return len(text)
