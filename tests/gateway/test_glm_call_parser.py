"""GLM's tool-call format (GLM-4.5 to GLM-5): a corpus of outputs, streamed every way, values typed
by the tools' schemas; the format detected from a GLM-shaped chat template.

What this file proves:
- every output in the corpus (single and parallel calls in GLM-4.5's layout and GLM-4.7/5's compact
  one; string, integer, number, boolean, null, nested object and array arguments, as `tojson`
  renders them with and without `ensure_ascii`; raw multi-line strings holding tags; text before,
  between and after calls; `<think>` reasoning, also opened by the prompt; blocks that are not calls,
  malformed calls and calls cut short at every point) parses to the `ParsedOutput` written next to
  it, tool calls as [name, arguments JSON text], and every call's arguments parse as a JSON object;
- the streaming driver gives exactly that result fed whole, one character at a time, one SmolLM2
  token at a time, and split at seeded random points, with no call text ever streamed as content
  and events in order; a string value streams before its `</arg_value>` closes it;
- `auto` picks `glm` from a template that renders `<arg_key>`; a chat request against it renders an
  earlier call the way the parser reads it back, opens the reasoning, and a forced tool choice is a
  400 naming `tool_choice`.
"""

from __future__ import annotations

import json
import random

import pytest

from talaria.config.schema import ToolParser
from talaria.gateway.errors import APIError
from talaria.gateway.openai_protocol import Endpoint, parse_request
from talaria.gateway.output_parser import (
    CallArguments,
    CallStart,
    Event,
    OutputParser,
    ParsedOutput,
    assemble,
    parse,
)
from talaria.gateway.tools import ModelFormats
from talaria.models.tokenizer import Tokenizer
from tests.gateway.fakes import MODEL
from tests.gateway.test_chat_prompt import HISTORY, TOOLS, TemplateCatalog, formats
from tests.gateway.test_output_parser import check_events, token_pieces
from tests.gateway.test_xml_call_parser import SCHEMAS, Case, case

GLM = ToolParser.GLM


def call(name: str, **args: str) -> str:
    """A call in GLM-4.5 and 4.6's layout: a newline after the name and after each tag pair."""
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
    return f"<tool_call>{name}\n{body}</tool_call>"


def compact(name: str, **args: str) -> str:
    """A call in GLM-4.7 and GLM-5's layout: no whitespace at all."""
    body = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in args.items())
    return f"<tool_call>{name}{body}</tool_call>"


PARIS = '{"city": "Paris", "days": 3}'
HEAD = "<tool_call>get_weather\n"
CASES = [
    # -- one call, parallel calls, text around them
    case("single", call("get_weather", city="Paris", days="3"), calls=[["get_weather", PARIS]]),
    case("single-compact", compact("get_weather", city="Paris", days="3"), calls=[["get_weather", PARIS]]),
    case("parallel-two", "\n" + call("get_weather", city="Paris") + "\n" + call("get_weather", city="Rome"),
         content="\n", calls=[["get_weather", '{"city": "Paris"}'], ["get_weather", '{"city": "Rome"}']]),
    case("parallel-three-compact-back-to-back",
         compact("get_time") + compact("get_weather", city="Oslo", unit="celsius")
         + compact("configure", verbose="false"),
         calls=[["get_time", "{}"], ["get_weather", '{"city": "Oslo", "unit": "celsius"}'],
                ["configure", '{"verbose": false}']]),
    case("text-before", "I'll check the weather.\n" + call("get_weather", city="Paris", days="3"),
         content="I'll check the weather.\n", calls=[["get_weather", PARIS]]),
    case("text-after", compact("get_weather", city="Paris", days="3") + "\n\nDone.", content="Done.",
         calls=[["get_weather", PARIS]]),
    case("text-between", "A " + compact("get_time") + " B " + call("get_time") + " C", content="A B C",
         calls=[["get_time", "{}"], ["get_time", "{}"]]),
    case("no-arguments", call("get_time"), calls=[["get_time", "{}"]]),
    case("spaces-around-name-and-tags", "<tool_call> get_weather \n <arg_key> days </arg_key>\n\n <arg_value>3"
         "</arg_value> \n</tool_call>", calls=[["get_weather", '{"days": 3}']]),
    case("mcp-style-name", compact("fs.v2:read_file", path="a.txt"), calls=[["fs.v2:read_file", '{"path": "a.txt"}']]),
    # -- values typed by the schema (non-strings as tojson renders them)
    case("string-stays-string", call("get_weather", city="42", unit="true"),
         calls=[["get_weather", '{"city": "42", "unit": "true"}']]),
    case("object-array-boolean-number",
         compact("configure", options='{"depth": 2, "paths": ["a", "b"]}', tags='["x", "y"]', verbose="true",
                 ratio="2.5", count="-3"),
         calls=[["configure", ('{"options": {"depth": 2, "paths": ["a", "b"]}, "tags": ["x", "y"], '
                               '"verbose": true, "ratio": 2.5, "count": -3}')]]),
    case("deeply-nested-unicode", compact("configure", options='{"城市": ["上海", {"深": [1, {"x": null}]}]}'),
         calls=[["configure", '{"options": {"城市": ["上海", {"深": [1, {"x": null}]}]}}']]),
    case("ascii-escaped-json", call("configure", options='{"c": "\\u4e0a\\n"}', tags='["\\u00e9"]'),
         calls=[["configure", '{"options": {"c": "上\\n"}, "tags": ["é"]}']]),
    case("array-of-objects", compact("configure", tags='[{"a": 1}, [], {}]'),
         calls=[["configure", '{"tags": [{"a": 1}, [], {}]}']]),
    case("pretty-printed-object", call("configure", options='{\n  "a": [\n    1,\n    2\n  ]\n}'),
         calls=[["configure", '{"options": {"a": [1, 2]}}']]),
    case("whitespace-around-a-typed-value", call("get_weather", days="\n 3 \n"),
         calls=[["get_weather", '{"days": 3}']]),
    case("null-and-string-or-null", compact("configure", limit="null", note="null"),
         calls=[["configure", '{"limit": null, "note": "null"}']]),
    case("any-of-integer", compact("configure", either="7"), calls=[["configure", '{"either": 7}']]),
    case("untyped-parameter-is-a-string", compact("configure", anything='{"a": 1}'),
         calls=[["configure", '{"anything": "{\\"a\\": 1}"}']]),
    case("unknown-parameter-is-a-string", compact("get_weather", city="Paris", extra="5"),
         calls=[["get_weather", '{"city": "Paris", "extra": "5"}']]),
    case("unknown-function-all-strings", call("not_offered", n="5", flag="true"),
         calls=[["not_offered", '{"n": "5", "flag": "true"}']]),
    case("no-schemas-all-strings", call("get_weather", days="3"), calls=[["get_weather", '{"days": "3"}']],
         schemas=None),
    case("typed-value-that-does-not-parse-stays-text",
         compact("configure", count="three", options="{not json", verbose="yes", ratio="NaN", tags="[1, 2"),
         calls=[["configure", ('{"count": "three", "options": "{not json", "verbose": "yes", "ratio": "NaN", '
                               '"tags": "[1, 2"}')]]),
    case("no-infinity", compact("configure", ratio="1e400"), calls=[["configure", '{"ratio": "1e400"}']]),
    # -- string values: the raw text, nothing stripped, JSON-escaped
    case("multi-line-file",
         call("write_file", path="src/a.py", content='def f(x):\n\treturn "<tool_call>" + x  # \\ and </tool_call>\n'),
         calls=[["write_file", ('{"path": "src/a.py", "content": "def f(x):\\n\\treturn \\"<tool_call>\\" + x  '
                                '# \\\\ and </tool_call>\\n"}')]]),
    case("string-keeps-its-whitespace", compact("write_file", content="\n  body \n"),
         calls=[["write_file", '{"content": "\\n  body \\n"}']]),
    case("empty-string", compact("write_file", content=""), calls=[["write_file", '{"content": ""}']]),
    case("value-holds-other-tags", compact("write_file", content="<arg_key>x</arg_key><arg_value></tool_call>"),
         calls=[["write_file", '{"content": "<arg_key>x</arg_key><arg_value></tool_call>"}']]),
    case("unicode", "Voilà 👍 " + compact("get_weather", city="Zürich 北京 😀"),
         content="Voilà 👍 ", calls=[["get_weather", '{"city": "Zürich 北京 😀"}']]),
    case("unicode-names", call("天气", 城市="上海"), calls=[["天气", '{"城市": "上海"}']]),
    case("duplicate-argument-as-written", compact("get_weather", city="A").replace(
         "</tool_call>", "<arg_key>city</arg_key><arg_value>B</arg_value></tool_call>"),
         calls=[["get_weather", '{"city": "A", "city": "B"}']]),
    # -- reasoning first
    case("think-then-call", "<think>The user wants Paris.</think>\n" + call("get_weather", city="Paris", days="3"),
         reasoning="The user wants Paris.", calls=[["get_weather", PARIS]], think=True),
    case("think-text-then-call", "\n<think>plan</think>Checking.\n" + compact("get_time"),
         reasoning="plan", content="Checking.\n", calls=[["get_time", "{}"]], think=True),
    case("empty-think-then-call", "<think></think>" + compact("get_time"), calls=[["get_time", "{}"]], think=True),
    case("call-inside-think-is-reasoning", "<think>maybe " + compact("get_time") + "</think>no call",
         reasoning="maybe " + compact("get_time"), content="no call", think=True),
    case("think-cut-short", "<think>unfinished <tool_call>get_", reasoning="unfinished <tool_call>get_", think=True),
    case("prompt-opened-think", "The user wants Paris.</think>" + compact("get_weather", city="Paris", days="3"),
         reasoning="The user wants Paris.", calls=[["get_weather", PARIS]], think=True, opened=True),
    case("prompt-opened-think-cut-short", "still thinking <arg", reasoning="still thinking <arg", think=True,
         opened=True),
    # -- not a call: content, as written
    case("plain", "No tools needed: 4.", content="No tools needed: 4."),
    case("stray-tags", "a <arg_key>k</arg_key> b </arg_value> c </tool_call> d",
         content="a <arg_key>k</arg_key> b </arg_value> c </tool_call> d"),
    case("sentence-inside", "<tool_call>Let me think</tool_call>", content="<tool_call>Let me think</tool_call>"),
    case("name-then-text", "<tool_call>get_time\nand more</tool_call>",
         content="<tool_call>get_time\nand more</tool_call>"),
    case("hermes-json-inside", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
         content='<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),
    case("qwen-xml-inside", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
         content="<tool_call>\n<function=get_time>\n</function>\n</tool_call>"),
    case("no-name", "<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
         content="<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"),
    case("bad-block-then-call", "<tool_call>oops!</tool_call>\n" + compact("get_time"),
         content="<tool_call>oops!</tool_call>\n", calls=[["get_time", "{}"]]),
    case("double-open-tag", "<tool_call>" + compact("get_time"), content="<tool_call>", calls=[["get_time", "{}"]]),
    # -- malformed after the head: call syntax is dropped, the call keeps what it has
    case("junk-between-arguments", HEAD + "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\nsome words <b>\n"
         "<arg_key>bad\nkey</arg_key>\n<arg_value>x</arg_value>\n<arg_key> </arg_key><arg_value>y</arg_value>\n"
         "</tool_call>", calls=[["get_weather", '{"city": "Paris"}']]),
    case("key-without-value", HEAD + "<arg_key>city</arg_key>\n</tool_call>", calls=[["get_weather", "{}"]]),
    case("no-close-then-call", "<tool_call>get_time\n" + call("get_weather", days="1"),
         calls=[["get_time", "{}"], ["get_weather", '{"days": 1}']]),
    case("no-close-then-text-is-call-syntax", HEAD + "<arg_key>days</arg_key><arg_value>2</arg_value>\nDone.",
         calls=[["get_weather", '{"days": 2}']]),
    # -- cut short (max_tokens) at every point of a call
    case("cut-in-open-tag", "Sure. <tool_ca", content="Sure. <tool_ca"),
    case("cut-right-after-open-tag", "Sure. <tool_call>", content="Sure. <tool_call>"),
    case("cut-in-name", "<tool_call>get_wea", content="<tool_call>get_wea"),
    case("cut-after-name", HEAD, content=HEAD),
    case("cut-in-first-key-tag", "<tool_call>get_weather<arg_", content="<tool_call>get_weather<arg_"),
    case("cut-after-first-key-tag", HEAD + "<arg_key>", calls=[["get_weather", "{}"]]),
    case("cut-in-key", HEAD + "<arg_key>ci", calls=[["get_weather", "{}"]]),
    case("cut-after-key", HEAD + "<arg_key>city</arg_key>\n<arg_va", calls=[["get_weather", "{}"]]),
    case("cut-after-value-tag", HEAD + "<arg_key>city</arg_key>\n<arg_value>", calls=[["get_weather", '{"city": ""}']]),
    case("cut-in-string-value", HEAD + "<arg_key>city</arg_key>\n<arg_value>Par",
         calls=[["get_weather", '{"city": "Par"}']]),
    case("cut-in-closing-tag", HEAD + "<arg_key>city</arg_key>\n<arg_value>Paris</arg_val",
         calls=[["get_weather", '{"city": "Paris"}']]),
    case("cut-in-integer-value", HEAD + "<arg_key>days</arg_key>\n<arg_value>1",
         calls=[["get_weather", '{"days": 1}']]),
    case("cut-in-object-value", '<tool_call>configure<arg_key>options</arg_key><arg_value>{"a": [1',
         calls=[["configure", '{"options": "{\\"a\\": [1"}']]),
    case("cut-after-value", HEAD + "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n",
         calls=[["get_weather", '{"days": 2}']]),
    case("cut-in-tool-call-close", "Ok " + call("get_weather", days="1")[:-5], content="Ok ",
         calls=[["get_weather", '{"days": 1}']]),
    case("cut-in-second-call", compact("get_time") + "<tool_call>write_file<arg_key>content</arg_key><arg_value>ab",
         calls=[["get_time", "{}"], ["write_file", '{"content": "ab"}']]),
]
CASE_PARAMS = [pytest.param(c, id=c.id) for c in CASES]


# ---- drivers and checks ------------------------------------------------------------------------


def stream(c: Case, pieces: list[str]) -> list[Event]:
    parser = OutputParser(GLM, c.think, c.schemas, c.opened)
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def check_stream(c: Case, events: list[Event]) -> None:
    check_events(events, parse(c.text, GLM, c.think, c.schemas, c.opened), c.expected)


def test_corpus_ids_are_unique():
    assert len({c.id for c in CASES}) == len(CASES) >= 60


@pytest.mark.parametrize("c", CASE_PARAMS)
def test_parse(c: Case):
    out = parse(c.text, GLM, c.think, c.schemas, c.opened)
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
    """A long file's content reaches the client as it is written, not when its argument closes."""
    parser = OutputParser(GLM, False, SCHEMAS)
    events = parser.feed("<tool_call>write_file<arg_key>content</arg_key><arg_value>line one\nline two</arg_")
    assert events == [CallStart(0, "write_file"), CallArguments(0, "{"), CallArguments(0, '"content": "'),
                      CallArguments(0, "line one\\nline two")]  # "</arg_" waits: it may close the value
    assert parser.feed("x") == [CallArguments(0, "</arg_x")]
    assert parser.feed("</arg_value></tool_call>") == [CallArguments(0, '"'), CallArguments(0, "}")]


# ---- the format from the chat template, and a request through it -------------------------------

# GLM-4.7 and GLM-5's shape: the tools as JSON, earlier calls rendered compact (strings raw, the rest
# by tojson), and a generation prompt that opens the reasoning.
GLM_TEMPLATE = r"""[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{%- endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>...</tool_call>
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
<|assistant|><think></think>{{ m.content or '' }}
{%- for tc in m.tool_calls or [] -%}
{%- set tc = tc.function -%}
{{- '<tool_call>' + tc.name -}}
{%- for k, v in tc.arguments.items() -%}
<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson(ensure_ascii=False) }}</arg_value>
{%- endfor -%}
</tool_call>
{%- endfor -%}
{%- elif m.role == 'tool' -%}
<|observation|><tool_response>{{ m.content }}</tool_response>
{%- else -%}
<|{{ m.role }}|>{{ m.content }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|><think>{%- endif -%}"""


def test_auto_detects_the_glm_format():
    assert formats(GLM_TEMPLATE) == ModelFormats(GLM, reasoning=True, template_tools=True)
    assert formats(GLM_TEMPLATE.replace("<arg_key>", "<key>")).tools is ToolParser.HERMES  # the marker decides
    assert formats(GLM_TEMPLATE, ToolParser.HERMES).tools is ToolParser.HERMES  # explicit wins
    assert formats(None, GLM).tools is GLM


@pytest.fixture(scope="module")
def glm() -> TemplateCatalog:
    return TemplateCatalog(GLM_TEMPLATE)


def test_a_chat_request_renders_calls_as_the_parser_reads_them(glm):
    p = parse_request(Endpoint.CHAT, {"model": MODEL, "messages": HISTORY, "tools": TOOLS}, glm)
    prompt = glm.tok.decode(list(p.prompt_token_ids))
    earlier = compact("get_weather", city="Paris", days="3")
    assert earlier in prompt and prompt.endswith("<|assistant|><think>")
    assert p.tool_format is GLM and p.reasoning and p.reasoning_open
    assert parse(earlier, GLM, False, p.tool_schemas).tool_calls == [["get_weather", PARIS]]  # a round trip
    output = "Rome now.</think>" + compact("get_weather", city="Rome", days="2")
    expected = ParsedOutput("", "Rome now.", [["get_weather", '{"city": "Rome", "days": 2}']])
    parser = p.output_parser()
    assert parser is not None
    events = [e for ch in output for e in parser.feed(ch)] + parser.finish()
    assert assemble(events) == p.parse_output(output) == expected  # streamed == whole


def test_a_forced_tool_choice_is_refused_until_glm_calls_can_be_constrained(glm):
    body = {"model": MODEL, "messages": HISTORY, "tools": TOOLS, "tool_choice": "required"}
    with pytest.raises(APIError) as e:
        parse_request(Endpoint.CHAT, body, glm)
    assert e.value.status == 400 and e.value.param == "tool_choice" and '"glm"' in str(e.value)
