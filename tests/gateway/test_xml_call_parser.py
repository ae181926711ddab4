"""The Qwen3-Coder / Qwen3.5 XML tool-call format: a corpus of outputs, streamed every way, values
typed by the tools' schemas (how the format is detected and the schemas arrive: test_chat_prompt.py).

What this file proves:
- every output in the corpus (single and parallel calls; string, integer, number, boolean, null,
  object and array parameters; multi-line values; text before and after calls; `<think>` reasoning,
  also opened by the prompt; malformed blocks and calls cut short) parses to the `ParsedOutput`
  written next to it, tool calls as [name, arguments JSON text], and every call's arguments parse
  as a JSON object;
- the streaming driver gives exactly that result fed whole, one character at a time, one SmolLM2
  token at a time, and split at seeded random points, with no call text ever streamed as content
  and events in order; a string value streams before its parameter closes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from talaria.config.schema import ToolParser
from talaria.gateway.output_parser import (
    CallArguments,
    CallStart,
    Event,
    OutputParser,
    ParsedOutput,
    parse,
)
from talaria.models.tokenizer import Tokenizer
from tests.gateway.test_output_parser import check_events, token_pieces

QWEN3_CODER = ToolParser.QWEN3_CODER

SCHEMAS: dict[str, Any] = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}},
    "configure": {"type": "object", "properties": {
        "options": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}},
        "verbose": {"type": "boolean"}, "ratio": {"type": "number"}, "count": {"type": "integer"},
        "note": {"type": ["string", "null"]}, "limit": {"type": ["integer", "null"]},
        "either": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
        "anything": {"description": "no type: taken as a string"}}},
    "write_file": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}},
    "get_time": {"type": "object", "properties": {}},
}


def call(name: str, **params: str) -> str:
    """A call as the models write it (and their templates render it): newlines around every value."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@dataclass(frozen=True)
class Case:
    id: str
    text: str
    expected: ParsedOutput
    think: bool  # the reasoning parser is on
    opened: bool  # the prompt ended inside <think>
    schemas: Mapping[str, Any] | None


def case(id: str, text: str, *, content: str = "", reasoning: str | None = None,
         calls: list[list[str]] | None = None, think: bool = False, opened: bool = False,
         schemas: Mapping[str, Any] | None = SCHEMAS) -> Case:
    return Case(id, text, ParsedOutput(content, reasoning, calls or []), think, opened, schemas)


PARIS = '{"city": "Paris", "days": 3}'
CASES = [
    # -- one call, parallel calls, text around them
    case("single", call("get_weather", city="Paris", days="3"), calls=[["get_weather", PARIS]]),
    case("parallel-two", call("get_weather", city="Paris") + "\n" + call("get_weather", city="Rome"),
         calls=[["get_weather", '{"city": "Paris"}'], ["get_weather", '{"city": "Rome"}']]),
    case("parallel-three-different",
         call("get_time") + "\n" + call("get_weather", city="Oslo", unit="celsius") + "\n"
         + call("configure", verbose="false"),
         calls=[["get_time", "{}"], ["get_weather", '{"city": "Oslo", "unit": "celsius"}'],
                ["configure", '{"verbose": false}']]),
    case("text-before", "I'll check the weather.\n\n" + call("get_weather", city="Paris", days="3"),
         content="I'll check the weather.\n\n", calls=[["get_weather", PARIS]]),
    case("text-after", call("get_weather", city="Paris", days="3") + "\n\nDone.", content="Done.",
         calls=[["get_weather", PARIS]]),
    case("text-between", "A " + call("get_time") + " B " + call("get_time") + " C", content="A B C",
         calls=[["get_time", "{}"], ["get_time", "{}"]]),
    case("compact-layout",
         "<tool_call><function=get_weather><parameter=city>Paris</parameter><parameter=days>3</parameter>"
         "</function></tool_call>", calls=[["get_weather", PARIS]]),
    case("spaces-around-tags", "<tool_call>  \n<function= get_weather >\n  <parameter= days >\n3\n</parameter>  "
         "\n</function> \n </tool_call>", calls=[["get_weather", '{"days": 3}']]),
    case("no-parameters", call("get_time"), calls=[["get_time", "{}"]]),
    # -- values typed by the schema
    case("string-stays-string", call("get_weather", city="42", unit="true"),
         calls=[["get_weather", '{"city": "42", "unit": "true"}']]),
    case("object-array-boolean-number",
         call("configure", options='{"depth": 2, "paths": ["a", "b"]}', tags='["x", "y"]', verbose="true",
              ratio="2.5", count="-3"),
         calls=[["configure", ('{"options": {"depth": 2, "paths": ["a", "b"]}, "tags": ["x", "y"], '
                               '"verbose": true, "ratio": 2.5, "count": -3}')]]),
    case("pretty-printed-object", call("configure", options='{\n  "a": [\n    1,\n    2\n  ]\n}'),
         calls=[["configure", '{"options": {"a": [1, 2]}}']]),
    case("python-rendered-booleans-and-none", call("configure", verbose="True", limit="None", either="False"),
         calls=[["configure", '{"verbose": true, "limit": null, "either": false}']]),
    case("null-and-string-or-null", call("configure", limit="null", note="null"),
         calls=[["configure", '{"limit": null, "note": "null"}']]),
    case("any-of-integer", call("configure", either="7"), calls=[["configure", '{"either": 7}']]),
    case("untyped-parameter-is-a-string", call("configure", anything='{"a": 1}'),
         calls=[["configure", '{"anything": "{\\"a\\": 1}"}']]),
    case("unknown-parameter-is-a-string", call("get_weather", city="Paris", extra="5"),
         calls=[["get_weather", '{"city": "Paris", "extra": "5"}']]),
    case("unknown-function-all-strings", call("not_offered", n="5", flag="true"),
         calls=[["not_offered", '{"n": "5", "flag": "true"}']]),
    case("no-schemas-all-strings", call("get_weather", days="3"), calls=[["get_weather", '{"days": "3"}']],
         schemas=None),
    case("typed-value-that-does-not-parse-stays-text",
         call("configure", count="three", options="{not json", verbose="yes", ratio="NaN", tags="[1, 2"),
         calls=[["configure", ('{"count": "three", "options": "{not json", "verbose": "yes", "ratio": "NaN", '
                               '"tags": "[1, 2"}')]]),
    case("no-infinity", call("configure", ratio="1e400"), calls=[["configure", '{"ratio": "1e400"}']]),
    case("leading-zero-is-not-an-integer", call("configure", count="007"), calls=[["configure", '{"count": "007"}']]),
    # -- string values: raw text, one newline stripped each side, JSON-escaped
    case("multi-line-file",
         call("write_file", path="src/a.py",
              content='def f(x):\n\treturn "<tool_call>" + x  # \\ and </function>\n\n'),
         calls=[["write_file", ('{"path": "src/a.py", "content": "def f(x):\\n\\treturn \\"<tool_call>\\" + x  '
                                '# \\\\ and </function>\\n\\n"}')]]),
    case("only-one-newline-stripped-each-side", call("write_file", content="\nbody\n"),
         calls=[["write_file", '{"content": "\\nbody\\n"}']]),
    case("empty-string", call("write_file", content=""), calls=[["write_file", '{"content": ""}']]),
    case("value-holds-other-tags",
         call("write_file", content="<parameter=x>\n</function>\n</tool_call>\n<tool_call>"),
         calls=[["write_file", '{"content": "<parameter=x>\\n</function>\\n</tool_call>\\n<tool_call>"}']]),
    case("newline-before-closing-tag-only", "<tool_call>\n<function=write_file>\n<parameter=content>a\n\n"
         "</parameter>\n</function>\n</tool_call>", calls=[["write_file", '{"content": "a\\n"}']]),
    case("unicode", "Voilà 👍 " + call("get_weather", city="Zürich 北京 😀"),
         content="Voilà 👍 ", calls=[["get_weather", '{"city": "Zürich 北京 😀"}']]),
    case("unicode-names", call("天气", 城市="上海"), calls=[["天气", '{"城市": "上海"}']]),
    case("duplicate-parameter-as-written", call("get_weather", city="A") .replace(
         "</function>", "<parameter=city>\nB\n</parameter>\n</function>"),
         calls=[["get_weather", '{"city": "A", "city": "B"}']]),
    # -- reasoning first
    case("think-then-call", "<think>\nThe user wants Paris.\n</think>\n\n" + call("get_weather", city="Paris",
                                                                                     days="3"),
         reasoning="\nThe user wants Paris.\n", calls=[["get_weather", PARIS]], think=True),
    case("think-text-then-call", "<think>plan</think>Checking.\n" + call("get_time"),
         reasoning="plan", content="Checking.\n", calls=[["get_time", "{}"]], think=True),
    case("call-inside-think-is-reasoning", "<think>maybe " + call("get_time") + "</think>no call",
         reasoning="maybe " + call("get_time"), content="no call", think=True),
    case("think-cut-short", "<think>unfinished <tool_call>", reasoning="unfinished <tool_call>", think=True),
    case("prompt-opened-think", "The user wants Paris.\n</think>\n\n" + call("get_weather", city="Paris", days="3"),
         reasoning="The user wants Paris.\n", calls=[["get_weather", PARIS]], think=True, opened=True),
    case("prompt-opened-think-cut-short", "still thinking <tool", reasoning="still thinking <tool", think=True,
         opened=True),
    case("prompt-opened-think-without-reasoning-parser", "x</think>y", content="x</think>y", opened=True),
    # -- not a call: content, as written
    case("plain", "No tools needed: 4.", content="No tools needed: 4."),
    case("stray-tags", "a <function=f> b </parameter> c </tool_call> d",
         content="a <function=f> b </parameter> c </tool_call> d"),
    case("hermes-json-inside", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
         content='<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),
    case("empty-function-name", "<tool_call>\n<function=>\n</function>\n</tool_call>",
         content="<tool_call>\n<function=>\n</function>\n</tool_call>"),
    case("newline-in-function-name", "<tool_call><function=get\nweather></function></tool_call>",
         content="<tool_call><function=get\nweather></function></tool_call>"),
    case("bad-block-then-call", "<tool_call>oops</tool_call>\n" + call("get_time"),
         content="<tool_call>oops</tool_call>\n", calls=[["get_time", "{}"]]),
    case("double-open-tag", "<tool_call>" + call("get_time"), content="<tool_call>", calls=[["get_time", "{}"]]),
    # -- malformed after the head: call syntax is dropped, the call keeps what it has
    case("junk-between-parameters", "<tool_call>\n<function=get_weather>\nsome words <b>\n<parameter=city>\n"
         "Paris\n</parameter>\n<parameter=bad\nname>\nx\n</parameter>\n</function>\n</tool_call>",
         calls=[["get_weather", '{"city": "Paris"}']]),
    case("no-close-function", "<tool_call>\n<function=get_time>\n</tool_call>ok", content="ok",
         calls=[["get_time", "{}"]]),
    case("no-close-tool-call-then-text", "<tool_call>\n<function=get_time>\n</function>\nDone.", content="Done.",
         calls=[["get_time", "{}"]]),
    case("no-close-tool-call-then-call", "<tool_call>\n<function=get_time>\n</function>\n" + call("get_time"),
         calls=[["get_time", "{}"], ["get_time", "{}"]]),
    case("no-close-tags-then-call", "<tool_call>\n<function=get_time>\n" + call("get_weather", days="1"),
         calls=[["get_time", "{}"], ["get_weather", '{"days": 1}']]),
    case("no-close-function-then-function", "<tool_call>\n<function=get_time>\n<function=get_weather>\n"
         "<parameter=days>\n1\n</parameter>\n</function>\n</tool_call>",
         calls=[["get_time", "{}"], ["get_weather", '{"days": 1}']]),
    case("two-functions-in-one-block", "<tool_call>\n<function=get_time>\n</function>\n<function=get_weather>\n"
         "<parameter=days>\n1\n</parameter>\n</function>\n</tool_call>",
         calls=[["get_time", "{}"], ["get_weather", '{"days": 1}']]),
    # -- cut short (max_tokens) at every point of a call
    case("cut-in-open-tag", "Sure. <tool_ca", content="Sure. <tool_ca"),
    case("cut-right-after-open-tag", "Sure. <tool_call>", content="Sure. <tool_call>"),
    case("cut-after-open-tag", "Sure. <tool_call>\n", content="Sure. <tool_call>\n"),
    case("cut-in-function-tag", "<tool_call>\n<funct", content="<tool_call>\n<funct"),
    case("cut-in-function-name", "<tool_call>\n<function=get_wea", content="<tool_call>\n<function=get_wea"),
    case("cut-after-function", "<tool_call>\n<function=get_weather>\n", calls=[["get_weather", "{}"]]),
    case("cut-in-parameter-tag", "<tool_call>\n<function=get_weather>\n<parameter=ci",
         calls=[["get_weather", "{}"]]),
    case("cut-after-parameter-tag", "<tool_call>\n<function=get_weather>\n<parameter=city>",
         calls=[["get_weather", '{"city": ""}']]),
    case("cut-in-string-value", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
         calls=[["get_weather", '{"city": "Par"}']]),
    case("cut-in-closing-tag", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</param",
         calls=[["get_weather", '{"city": "Paris"}']]),
    case("cut-in-integer-value", "<tool_call>\n<function=get_weather>\n<parameter=days>\n1",
         calls=[["get_weather", '{"days": 1}']]),
    case("cut-in-object-value", '<tool_call>\n<function=configure>\n<parameter=options>\n{"a": [1',
         calls=[["configure", '{"options": "{\\"a\\": [1"}']]),
    case("cut-after-parameter", "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n",
         calls=[["get_weather", '{"days": 2}']]),
    case("cut-in-function-close", "<tool_call>\n<function=get_time>\n</func", calls=[["get_time", "{}"]]),
    case("cut-in-tool-call-close", "Ok " + call("get_time")[:-5], content="Ok ", calls=[["get_time", "{}"]]),
    case("cut-in-second-call", call("get_time") + "\n<tool_call>\n<function=write_file>\n<parameter=content>\nab",
         calls=[["get_time", "{}"], ["write_file", '{"content": "ab"}']]),
]
CASE_PARAMS = [pytest.param(c, id=c.id) for c in CASES]


# ---- drivers and checks ------------------------------------------------------------------------


def stream(c: Case, pieces: list[str]) -> list[Event]:
    parser = OutputParser(QWEN3_CODER, c.think, c.schemas, c.opened)
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def check_stream(c: Case, events: list[Event]) -> None:
    check_events(events, parse(c.text, QWEN3_CODER, c.think, c.schemas, c.opened), c.expected)


def test_corpus_ids_are_unique():
    assert len({c.id for c in CASES}) == len(CASES) >= 60


@pytest.mark.parametrize("c", CASE_PARAMS)
def test_parse(c: Case):
    out = parse(c.text, QWEN3_CODER, c.think, c.schemas, c.opened)
    assert out == c.expected
    assert all(isinstance(json.loads(arguments), dict) for _, arguments in out.tool_calls)  # even when cut short


@pytest.mark.parametrize("c", CASE_PARAMS)
def test_whole_text_in_one_feed(c: Case):
    check_stream(c, stream(c, [c.text]))


@pytest.mark.parametrize("c", CASE_PARAMS)
def test_one_character_at_a_time(c: Case):
    check_stream(c, stream(c, list(c.text)))


@pytest.mark.parametrize("c", CASE_PARAMS)
def test_random_splits(c: Case):
    rng = random.Random(c.id)
    for _ in range(20):
        cuts = sorted(rng.randint(0, len(c.text)) for _ in range(rng.randint(1, 12)))  # repeats: empty feeds
        pieces = [c.text[a:b] for a, b in zip([0, *cuts], [*cuts, len(c.text)], strict=True)]
        check_stream(c, stream(c, pieces))


@pytest.fixture(scope="module")
def tokenizer(smollm_tokenizer) -> Tokenizer:
    return smollm_tokenizer


@pytest.mark.parametrize("c", CASE_PARAMS)
def test_one_token_at_a_time(c: Case, tokenizer: Tokenizer):
    pieces = token_pieces(tokenizer, c.text)
    assert "".join(pieces) == c.text
    check_stream(c, stream(c, pieces))


def test_string_values_stream_before_they_close():
    """A long file's content reaches the client as it is written, not when its parameter closes."""
    parser = OutputParser(QWEN3_CODER, False, SCHEMAS)
    events = parser.feed("<tool_call>\n<function=write_file>\n<parameter=content>\nline one\nline two\n")
    assert events == [CallStart(0, "write_file"), CallArguments(0, "{"), CallArguments(0, '"content": "'),
                      CallArguments(0, "line one\\nline two")]  # the last newline waits: it may end the value
    assert parser.feed("line three") == [CallArguments(0, "\\nline three")]
    assert parser.feed("\n</parameter>") == [CallArguments(0, '"')]
