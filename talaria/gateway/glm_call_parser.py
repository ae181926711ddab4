"""Tool calls in the format of GLM-4.5, 4.6, 4.7 and GLM-5 (`ToolParser.GLM`), read as the text is
generated.

What the models write (and their chat templates render for earlier calls): GLM-4.5 and 4.6 put a
newline after the name and after each tag pair, GLM-4.7 and GLM-5 nothing:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

    <tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>

any number of them, text before, between and after. `GlmCallParser` reads the answer (the output
after any reasoning, which `OutputParser` splits off first) and emits the same events as the other
formats: `CallStart` once the call's head is complete, then the arguments as the text of a JSON
object built from the arguments as they come, `{"city": "Paris", "days": 3}`.

**Values are raw text, typed by the tool's JSON schema.** The templates render a string value as it
is and any other as JSON (`v if v is string else v | tojson`), so a value is all the text between
`<arg_value>` and `</arg_value>`, nothing stripped, and is a string or JSON by the rule of
talaria/gateway/arguments_writer.py (the one the Qwen3-Coder format shares). String values stream as
they arrive; a typed value is written when its `</arg_value>` closes it.

A call's head is the function name right after `<tool_call>` (one word: letters, digits, `_`, `-`,
`.`, `:`; whitespace around it is allowed), complete once `<arg_key>` or `</tool_call>` follows it
(or `<tool_call>`: a call without arguments that was never closed). Waiting for that tag rather than
for the newline costs one token and keeps `<tool_call>Sure\\nhere it is</tool_call>` content: a block
that is not a call before its head completes (a sentence, Hermes JSON, truncated) is content, as
written. An argument is `<arg_key>KEY</arg_key>`, optional whitespace, `<arg_value>` (KEY on one
line, not blank, whitespace around it dropped); its value is raw text up to `</arg_value>`, so it
may hold any other tag. Call syntax is never content: whitespace between the tags, text inside a
call that is not an argument (a key without a value, text after the last argument of a call never
closed), a tag cut short at the end. A call cut short (max_tokens, a stop) keeps the arguments it
has, its last value as far as it got, and its JSON is closed, so its arguments always parse. A
`<tool_call>` between arguments ends a call whose `</tool_call>` never came.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import Enum
from typing import Any

from talaria.gateway.arguments_writer import ArgumentsWriter
from talaria.gateway.json_scan import PARTIAL, WHITESPACE
from talaria.gateway.output_events import Content, Event, held

TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"
ARG_KEY, END_ARG_KEY = "<arg_key>", "</arg_key>"
ARG_VALUE, END_ARG_VALUE = "<arg_value>", "</arg_value>"
NAME = re.compile(r"[\w.:-]+")  # a function name: OpenAI's letters, digits, _ and -, and MCP's . and :
HEAD_ENDS = (ARG_KEY, END_TOOL_CALL, TOOL_CALL)  # what may follow a name (the last: a call never closed)


class _State(Enum):
    CONTENT = 0  # text, up to the next <tool_call>
    HEAD = 1  # after <tool_call>, until its name is complete (or turns out not to be one)
    BODY = 2  # inside a call, between its arguments
    VALUE = 3  # inside an argument's value
    SKIP_SPACE = 4  # whitespace after </tool_call>: it separates calls, it is not an answer


class GlmCallParser:
    """The answer of a GLM model, in pieces of any size: content and calls."""

    def __init__(self, schemas: Mapping[str, Any] | None = None) -> None:
        self._args = ArgumentsWriter(schemas)  # the calls' JSON, typed by `schemas`
        self._state = _State.CONTENT
        self._buf = ""  # text fed and not yet turned into events

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Event]:
        """The end of the output: flush what was held back, close a call cut short."""
        out: list[Event] = []
        while self._step(out, final=True):
            pass
        if self._state is _State.HEAD:  # cut right after <tool_call>: not a call
            out.append(Content(TOOL_CALL))
        if self._state is _State.VALUE:
            rest = self._buf
            out.append(self._args.end(rest[:len(rest) - held(rest, END_ARG_VALUE)]))  # (a cut closing tag is syntax)
        if self._state in (_State.BODY, _State.VALUE):
            out.append(self._args.close())
        self._buf, self._state = "", _State.CONTENT
        return out

    # ---- the state machine: each step consumes some of the buffer, or says it needs more ----------

    def _step(self, out: list[Event], final: bool) -> bool:
        s, buf = self._state, self._buf
        if not buf:
            return False
        if s is _State.CONTENT:
            i = buf.find(TOOL_CALL)
            if i < 0:
                keep = 0 if final else held(buf, TOOL_CALL)
                if len(buf) > keep:
                    out.append(Content(buf[:len(buf) - keep]))
                    self._buf = buf[len(buf) - keep:]
                return False
            if i:
                out.append(Content(buf[:i]))
            self._buf, self._state = buf[i + len(TOOL_CALL):], _State.HEAD
            return True
        if s is _State.SKIP_SPACE:
            self._buf = buf.lstrip(WHITESPACE)
            if not self._buf:
                return False
            self._state = _State.CONTENT
            return True
        if s is _State.VALUE:
            return self._value(out, final)
        if s is _State.HEAD:
            match = _head(buf)
            if match is PARTIAL and not final:
                return False
            if not isinstance(match, tuple):  # not a call: the block is content, as written
                out.append(Content(TOOL_CALL))
                self._state = _State.CONTENT
                return True
            name, end = match
            out += self._args.open(name)
            self._buf, self._state = buf[end:], _State.BODY
            return True
        return self._body(out, buf.lstrip(WHITESPACE))

    def _body(self, out: list[Event], rest: str) -> bool:
        """Inside a call: the next argument, or what ends the call (a new call's tag ends one whose
        closing tag never came)."""
        for tag, then in ((END_TOOL_CALL, _State.SKIP_SPACE), (TOOL_CALL, _State.HEAD)):
            if rest.startswith(tag):
                out.append(self._args.close())
                self._buf, self._state = rest[len(tag):], then
                return True
        match = _argument(rest)
        if match is PARTIAL or END_TOOL_CALL.startswith(rest) or TOOL_CALL.startswith(rest):
            self._buf = rest  # whitespace, or a tag still arriving (at the end: dropped)
            return False
        if match is None:  # not an argument: skip to the next tag
            i = rest.find("<", 1)
            self._buf = rest[i:] if i > 0 else ""
            return i > 0
        key, end = match
        out.append(self._args.key(key))
        self._buf, self._state = rest[end:], _State.VALUE
        return True

    def _value(self, out: list[Event], final: bool) -> bool:
        buf = self._buf
        i = buf.find(END_ARG_VALUE)
        if i >= 0:
            out.append(self._args.end(buf[:i]))
            self._buf, self._state = buf[i + len(END_ARG_VALUE):], _State.BODY
            return True
        if self._args.is_string and not final:  # stream it, but for what may be "</arg_value>"
            cut = len(buf) - held(buf, END_ARG_VALUE)
            if cut:
                out.append(self._args.piece(buf[:cut]))
                self._buf = buf[cut:]
        return False


def _head(text: str) -> tuple[str, int] | object | None:
    """A function name at the start of `text` (after whitespace), followed (after whitespace) by one
    of `HEAD_ENDS`: (the name, the offset after it); PARTIAL while `text` could still become one;
    None if it cannot."""
    start = len(text) - len(text.lstrip(WHITESPACE))
    name = NAME.match(text, start)
    if name is None:
        return PARTIAL if start == len(text) else None
    after = text[name.end():].lstrip(WHITESPACE)
    if any(after.startswith(tag) for tag in HEAD_ENDS):
        return name.group(), name.end()
    return PARTIAL if any(tag.startswith(after) for tag in HEAD_ENDS) else None


def _argument(text: str) -> tuple[str, int] | object | None:
    """`<arg_key>KEY</arg_key>`, whitespace, `<arg_value>` at the start of `text`, KEY on one line
    and not blank: (KEY stripped, the offset after `<arg_value>`); PARTIAL while `text` could still
    become one; None if it cannot."""
    if not text.startswith(ARG_KEY):
        return PARTIAL if ARG_KEY.startswith(text) else None
    start = len(ARG_KEY)
    stop = next((i for i in range(start, len(text)) if text[i] in "<\n"), len(text))  # where KEY must end
    close = text[stop:]
    if not close.startswith(END_ARG_KEY):
        return PARTIAL if END_ARG_KEY.startswith(close) else None
    key = text[start:stop].strip()
    value = close[len(END_ARG_KEY):].lstrip(WHITESPACE)
    if not key:
        return None
    if value.startswith(ARG_VALUE):
        return key, len(text) - len(value) + len(ARG_VALUE)
    return PARTIAL if ARG_VALUE.startswith(value) else None
