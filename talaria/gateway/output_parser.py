"""A model's output text split into reasoning, content and tool calls, incrementally.

One parser, two drivers. `OutputParser.feed` takes the text as it is generated, in pieces of any
size, and returns events (`Content`, `Reasoning`, `CallStart`, `CallArguments`); `finish` flushes
what it held back. The streaming response sends the events as they come; the whole response is
`parse(text)`, the same parser fed everything at once. The parser's events never depend on how the
text was split (tests feed it character by character, token by token and at arbitrary splits), so
the two responses always carry the same tool calls and content, and no text that turns out to be
part of a tool call is ever sent as content.

What it recognises:
- **Reasoning** (models that think first, Qwen3's format): output that starts with `<think>`
  (after optional whitespace) is reasoning up to `</think>`; whitespace after it is dropped. Tool
  calls inside reasoning are reasoning. When the prompt itself ends inside `<think>` (Qwen3.5's
  generation prompt opens it: `reasoning_open`), the output is reasoning from its first character.
- **Hermes / Qwen tool calls** (`ToolParser.HERMES`): `<tool_call>{"name": N, "arguments": A}</tool_call>`
  anywhere in the content, any number of them, text before, between and after (whitespace right
  after a call's closing tag is dropped: it separates calls, it is not an answer).
- **Llama-3 JSON tool calls** (`ToolParser.LLAMA3_JSON`): output that starts (after whitespace,
  and an optional `<|python_tag|>`) with `{"name": N, "parameters": A}`; several separated by `;`;
  text after the last is content. Output that starts otherwise is all content.
- **Qwen3-Coder / Qwen3.5 XML tool calls** (`ToolParser.QWEN3_CODER`): `<tool_call><function=N>
  <parameter=P>value</parameter></function></tool_call>`, values typed by the tool's schema; the
  answer after the reasoning is read by `XmlCallParser` (talaria/gateway/xml_call_parser.py), whose
  docstring has its rules. The events are the same (talaria/gateway/output_events.py).
- **GLM tool calls** (`ToolParser.GLM`, GLM-4.5 to GLM-5): `<tool_call>N<arg_key>K</arg_key>
  <arg_value>V</arg_value></tool_call>`, values typed by the tool's schema; the answer after the
  reasoning is read by `GlmCallParser` (talaria/gateway/glm_call_parser.py), the same way.

A JSON call (Hermes, Llama 3) begins once its head is complete: `{"name": N, "arguments": ` (the key
may also be `"parameters"`, whitespace may come between the parts) and the first character of the
value. Then `CallStart` names it and the text of the arguments value follows as `CallArguments`
pieces as it arrives. A call cut short (max_tokens, a stop) keeps the arguments it has; a Hermes
call whose JSON never closes ends at its `</tool_call>` (outside a string). A block that is not a
call before its head completes (malformed, another key first, no arguments, truncated) is content,
as it was written. Call syntax is never content: whitespace around calls, a `;` or `</tool_call>`
left dangling at the end, and what precedes a Llama-3 call (whitespace, `<|python_tag|>`) are
dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from talaria.config.schema import ToolParser
from talaria.gateway.glm_call_parser import GlmCallParser
from talaria.gateway.json_scan import PARTIAL, WHITESPACE, ValueScanner, match_head
from talaria.gateway.output_events import (
    CallArguments,
    CallStart,
    Content,
    Event,
    Reasoning,
    held,
)
from talaria.gateway.xml_call_parser import XmlCallParser

THINK, END_THINK = "<think>", "</think>"
TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TAG_PARSERS = {ToolParser.QWEN3_CODER: XmlCallParser, ToolParser.GLM: GlmCallParser}  # formats read by their own parser


@dataclass
class ParsedOutput:
    content: str = ""
    reasoning: str | None = None  # None: the output had no reasoning (no section, or an empty one)
    tool_calls: list[list[str]] = field(default_factory=list)  # [name, arguments JSON text] by index


def assemble(events: list[Event]) -> ParsedOutput:
    """What a list of events adds up to (the whole response; what a streaming client reassembles)."""
    out = ParsedOutput()
    content, reasoning = [], []
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, Reasoning):
            reasoning.append(e.text)
        elif isinstance(e, CallStart):
            out.tool_calls.append([e.name, ""])
        else:
            out.tool_calls[e.index][1] += e.text
    out.content = "".join(content)
    out.reasoning = "".join(reasoning) if reasoning else None
    return out


def parse(text: str, tools: ToolParser | None, reasoning: bool, schemas: Mapping[str, Any] | None = None,
          reasoning_open: bool = False) -> ParsedOutput:
    """The whole output at once: the same parser, fed everything."""
    p = OutputParser(tools, reasoning, schemas, reasoning_open)
    return assemble(p.feed(text) + p.finish())


class _State(Enum):
    START = 0  # nothing decided yet (reasoning? a Llama-3 call?)
    REASONING = 1
    SKIP_SPACE = 2  # dropping whitespace after </think>, or after a Hermes call's </tool_call>
    CONTENT = 3
    HEAD = 4  # inside a call object, before its arguments value: `{"name": "...", "arguments": `
    ARGUMENTS = 5  # inside the arguments value
    TAIL = 6  # after the arguments value, up to the end of the call object
    CLOSE = 7  # after a call object: </tool_call> (Hermes) or ; (Llama-3)
    TEXT = 8  # Llama-3 output that is not calls: everything is content


class OutputParser:
    """`schemas`: the offered functions' parameter schemas by name (the tag formats, Qwen3-Coder's and
    GLM's, type their values by them). `reasoning_open`: the prompt ends inside `<think>`, so the
    output starts as reasoning."""

    def __init__(self, tools: ToolParser | None, reasoning: bool, schemas: Mapping[str, Any] | None = None,
                 reasoning_open: bool = False) -> None:
        self.tools = tools
        self.reasoning = reasoning
        self._state = _State.REASONING if reasoning and reasoning_open else _State.START
        self._tags = TAG_PARSERS[tools](schemas) if tools in TAG_PARSERS else None  # reads the answer
        self._buf = ""  # text fed and not yet turned into events
        self._calls = 0  # calls started
        self._raw = ""  # a call block's text so far, in case it turns out not to be a call
        self._value = self._scanner()  # the arguments value, then the rest of the call object

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Event]:
        """The end of the output: flush what was held back, settle an unfinished block."""
        out: list[Event] = []
        while self._step(out, final=True):
            pass
        s, buf = self._state, self._buf
        if s is _State.REASONING and buf:
            out.append(Reasoning(buf))
        elif s in (_State.START, _State.CONTENT, _State.TEXT) and buf:
            out.append(Content(buf))
        elif s is _State.HEAD:  # cut short before its name was complete: not a call
            out.append(Content(self._raw + buf))
        if self._tags is not None:
            out += self._tags.finish()
        self._buf = ""
        return out

    # ---- the state machine: each step consumes some of the buffer, or says it needs more ----------

    def _step(self, out: list[Event], final: bool) -> bool:
        s, buf = self._state, self._buf
        if not buf:
            return False
        if s is _State.START:
            return self._start(out, final)
        if s is _State.REASONING:
            i = self._text_before(END_THINK, Reasoning, out)
            if i < 0:
                return False
            self._buf, self._state = buf[i + len(END_THINK):], _State.SKIP_SPACE
            return True
        if s is _State.SKIP_SPACE:
            rest = buf.lstrip(WHITESPACE)
            self._buf = rest
            if not rest:
                return False
            self._state = _State.CONTENT
            if self.tools is ToolParser.LLAMA3_JSON:
                self._state = _State.START  # calls may open the answer after the reasoning
                self.reasoning = False
            return True
        if s is _State.CONTENT or s is _State.TEXT:
            return self._content(out)
        if s is _State.HEAD:
            return self._head(out, final)
        if s is _State.ARGUMENTS:
            n = self._value.scan(buf, final)
            piece = buf[:n]
            if piece:
                out.append(CallArguments(self._calls - 1, piece))
            self._buf = buf[n:]
            if self._value.closed:  # a closing tag came first: the call ends there, unclosed
                self._state = _State.CLOSE
                return True
            if self._value.done:
                self._state, self._value = _State.TAIL, self._scanner(depth=1)
                return True
            return False
        if s is _State.TAIL:  # skip to the end of the call object (extra keys are ignored)
            n = self._value.scan(buf, final)
            self._buf = buf[n:]
            if self._value.done or self._value.closed:
                self._state = _State.CLOSE
                return True
            return False
        return self._close(out, final)

    def _start(self, out: list[Event], final: bool) -> bool:
        buf = self._buf
        rest = buf.lstrip(WHITESPACE)
        if self.reasoning:
            if rest.startswith(THINK):
                self._buf, self._state = rest[len(THINK):], _State.REASONING
                return True
            if not final and (not rest or THINK.startswith(rest)):
                return False  # maybe "<think>" still arriving
        if self.tools is ToolParser.LLAMA3_JSON:
            if rest.startswith(PYTHON_TAG):
                rest = rest[len(PYTHON_TAG):].lstrip(WHITESPACE)
                if not rest and not final:
                    return False  # the tag, and maybe a call after it
            if rest.startswith("{"):
                self._open_call(rest, buf[:len(buf) - len(rest)])
                return True
            if not final and (not rest or PYTHON_TAG.startswith(rest)):
                return False
            self._state = _State.TEXT
            return True
        self._state = _State.CONTENT
        return True

    def _content(self, out: list[Event]) -> bool:
        buf = self._buf
        if self._tags is not None:
            out += self._tags.feed(buf)
            self._buf = ""
            return False
        if self._state is _State.TEXT or self.tools is not ToolParser.HERMES:
            out.append(Content(buf))
            self._buf = ""
            return False
        i = self._text_before(TOOL_CALL, Content, out)
        if i < 0:
            return False
        self._open_call(buf[i + len(TOOL_CALL):], TOOL_CALL)
        return True

    def _text_before(self, tag: str, kind: type[Content | Reasoning], out: list[Event]) -> int:
        """Emit the buffer up to `tag` as a `kind` event and return where `tag` starts; or, while it
        has not arrived, emit all but a tail that may be its beginning (kept buffered) and return -1."""
        buf = self._buf
        i = buf.find(tag)
        if i < 0:
            keep = held(buf, tag)
            if len(buf) > keep:
                out.append(kind(buf[:len(buf) - keep]))
                self._buf = buf[len(buf) - keep:]
            return -1
        if i:
            out.append(kind(buf[:i]))
        return i

    def _scanner(self, depth: int = 0) -> ValueScanner:
        """Hermes calls end at their closing tag even when their JSON does not close."""
        return ValueScanner(depth, END_TOOL_CALL if self.tools is ToolParser.HERMES else None)

    def _open_call(self, rest: str, raw: str) -> None:
        self._buf, self._raw, self._state = rest, raw, _State.HEAD

    def _head(self, out: list[Event], final: bool) -> bool:
        match = match_head(self._buf)
        if match is PARTIAL:
            if not final:
                return False
            match = None
        if match is None:  # not a call: the block is content, as written
            if self._raw:
                out.append(Content(self._raw))
            self._state = _State.TEXT if self.tools is ToolParser.LLAMA3_JSON else _State.CONTENT
            return True
        name, end = match
        out.append(CallStart(self._calls, name))
        self._calls += 1
        self._buf, self._state, self._value = self._buf[end:], _State.ARGUMENTS, self._scanner()
        return True

    def _close(self, out: list[Event], final: bool) -> bool:
        rest = self._buf.lstrip(WHITESPACE)
        if self.tools is ToolParser.HERMES:
            if rest.startswith(END_TOOL_CALL):
                self._buf, self._state = rest[len(END_TOOL_CALL):], _State.SKIP_SPACE
                return True
            if not rest or END_TOOL_CALL.startswith(rest):
                self._buf = "" if final else rest  # (cut short at the end: still the call's closing tag)
                return False
            self._buf, self._state = rest, _State.CONTENT  # no closing tag: what follows is content
            return True
        if rest.startswith(";"):
            after = rest[1:].lstrip(WHITESPACE)
            if after.startswith("{"):
                self._open_call(after, rest[:len(rest) - len(after)])
                return True
            if not after:
                self._buf = "" if final else rest  # a separator with nothing after it ends the calls
                return False
            self._buf, self._state = rest, _State.TEXT  # not another call: the rest is content, as written
            return True
        if not final and not rest:
            self._buf = rest
            return False
        self._buf, self._state = rest, _State.TEXT  # trailing text after the calls
        return True

