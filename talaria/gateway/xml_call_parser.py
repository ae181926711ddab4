"""Tool calls in the XML format of Qwen3-Coder and Qwen3.5 (`ToolParser.QWEN3_CODER`), read as
the text is generated.

What the models write (and their chat templates render for earlier calls):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

any number of them, text before, between and after. `XmlCallParser` reads the answer (the output
after any reasoning, which `OutputParser` splits off first) and emits the same events as the JSON
formats: `CallStart` once `<function=NAME>` is complete, then the arguments as the text of a JSON
object, built from the parameters as they close, `{"city": "Paris", "days": 3}`.

**Values are raw text, typed by the tool's JSON schema** (the request's `tools`): one leading and
one trailing newline are dropped (the template writes them around every value), and the rest is a
string or JSON by the rule of talaria/gateway/arguments_writer.py, which writes the arguments (and
is shared with GLM's format). String values stream as they arrive; a typed value is written when its
`</parameter>` closes it.

A value is raw text up to `</parameter>`, so it may hold any other tag. A block is a call once its
`<function=NAME>` is complete (the name on one line, not empty); before that a block that is not a
call (malformed, truncated) is content, as written. Call syntax is never content: whitespace between
the tags, text inside a function that is not a parameter, a closing tag cut short at the end. A call
cut short (max_tokens, a stop) keeps the parameters it has, its last value as far as it got, and
its JSON is closed, so its arguments always parse. A `</tool_call>`, `<tool_call>` or `<function=`
between parameters ends a call whose `</function>` never came; text after `</function>` that is not
`</tool_call>` (or another `<function=`) is content.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

from talaria.gateway.arguments_writer import ArgumentsWriter
from talaria.gateway.json_scan import PARTIAL, WHITESPACE
from talaria.gateway.output_events import Content, Event, held

TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"
FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"


class _State(Enum):
    CONTENT = 0  # text, up to the next <tool_call>
    HEAD = 1  # after <tool_call>, until its <function=NAME> is complete (or turns out not to be)
    BODY = 2  # inside a function, between its parameters
    VALUE = 3  # inside a parameter's value
    AFTER = 4  # after </function>: </tool_call> (or another <function=)
    SKIP_SPACE = 5  # whitespace after </tool_call>: it separates calls, it is not an answer


class XmlCallParser:
    """The answer of a Qwen3-Coder / Qwen3.5 model, in pieces of any size: content and calls."""

    def __init__(self, schemas: Mapping[str, Any] | None = None) -> None:
        self._args = ArgumentsWriter(schemas)  # the calls' JSON, typed by `schemas`
        self._state = _State.CONTENT
        self._buf = ""  # text fed and not yet turned into events
        self._fresh = False  # the current value has not begun: its leading newline may still come

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
            rest = self._buf.removeprefix("\n") if self._fresh else self._buf
            self._end_value(out, rest[:len(rest) - held(rest, END_PARAMETER)])  # (a cut closing tag is syntax)
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
        rest = buf.lstrip(WHITESPACE)
        if s is _State.HEAD:
            match = _tag(rest, FUNCTION)
            if match is PARTIAL and not final:
                return False
            if not isinstance(match, tuple):  # not a call: the block is content, as written
                out.append(Content(TOOL_CALL))
                self._state = _State.CONTENT
                return True
            self._open_call(out, match, rest)
            return True
        if s is _State.BODY:
            return self._body(out, rest)
        # AFTER
        if rest.startswith(END_TOOL_CALL):
            self._buf, self._state = rest[len(END_TOOL_CALL):], _State.SKIP_SPACE
            return True
        match = _tag(rest, FUNCTION)
        if isinstance(match, tuple):  # another function in the same block
            self._open_call(out, match, rest)
            return True
        if match is PARTIAL or END_TOOL_CALL.startswith(rest):
            self._buf = rest  # a tag still arriving (cut short at the end: call syntax, dropped)
            return False
        self._buf, self._state = rest, _State.CONTENT  # no closing tag: what follows is content
        return True

    def _open_call(self, out: list[Event], match: tuple[str, int], rest: str) -> None:
        name, end = match
        out += self._args.open(name)
        self._buf, self._state = rest[end:], _State.BODY

    def _body(self, out: list[Event], rest: str) -> bool:
        """Inside a function: the next parameter, or what ends the call (a new call's tags end one
        whose closing tags never came)."""
        for tag, then in ((END_FUNCTION, _State.AFTER), (END_TOOL_CALL, _State.SKIP_SPACE), (TOOL_CALL, _State.HEAD)):
            if rest.startswith(tag):
                out.append(self._args.close())
                self._buf, self._state = rest[len(tag):], then
                return True
        function = _tag(rest, FUNCTION)
        if isinstance(function, tuple):
            out.append(self._args.close())
            self._open_call(out, function, rest)
            return True
        match = _tag(rest, PARAMETER)
        if PARTIAL in (match, function) or any(t.startswith(rest) for t in (END_FUNCTION, END_TOOL_CALL, TOOL_CALL)):
            self._buf = rest  # whitespace, or a tag still arriving (at the end: dropped)
            return False
        if match is None:  # not a parameter: skip to the next tag
            i = rest.find("<", 1)
            self._buf = rest[i:] if i > 0 else ""
            return i > 0
        name, end = match
        out.append(self._args.key(name))
        self._fresh = True
        self._buf, self._state = rest[end:], _State.VALUE
        return True

    def _value(self, out: list[Event], final: bool) -> bool:
        buf = self._buf
        if self._fresh:  # the first character decides whether there is a leading newline to drop
            buf = self._buf = buf.removeprefix("\n")
            self._fresh = False
        i = buf.find(END_PARAMETER)
        if i >= 0:
            self._end_value(out, buf[:i])
            self._buf, self._state = buf[i + len(END_PARAMETER):], _State.BODY
            return True
        if self._args.is_string and not final:  # stream it, but for what may be "\n</parameter>"
            cut = len(buf) - held(buf, END_PARAMETER)
            if cut and buf[cut - 1] == "\n":
                cut -= 1
            if cut:
                out.append(self._args.piece(buf[:cut]))
                self._buf = buf[cut:]
        return False

    def _end_value(self, out: list[Event], text: str) -> None:
        out.append(self._args.end(text.removesuffix("\n")))  # (the template's newline before the tag)


def _tag(text: str, prefix: str) -> tuple[str, int] | object | None:
    """`prefix` NAME `>` at the start of `text`, NAME on one line and not blank: (NAME, the offset
    after `>`); PARTIAL while `text` could still become one; None if it cannot."""
    if not text.startswith(prefix):
        return PARTIAL if prefix.startswith(text) else None
    end, line = text.find(">", len(prefix)), text.find("\n", len(prefix))
    if end < 0:
        return None if line >= 0 else PARTIAL
    name = text[len(prefix):end].strip()
    return (name, end + 1) if name and not 0 <= line < end else None

