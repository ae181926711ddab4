"""Chat prompts for the XML tool-call format (Qwen3-Coder, Qwen3.5): the format detected from the
chat template, and what a request hands the output parser.

What this file proves:
- `auto` picks `qwen3_coder` from a Qwen3-Coder or Qwen3.5 template (and not from a Llama template
  that only mentions `<function=`); an explicit setting wins;
- a chat request against a Qwen3.5-shaped template renders earlier calls in XML, and hands the
  parser its tools' schemas (values come back typed) and the reasoning its prompt opened, the same
  to the streamed and the whole response; a constrained answer never starts as reasoning; a forced
  tool choice, which Talaria cannot yet constrain in this format, is a 400 naming `tool_choice`.
"""

from __future__ import annotations

import pytest

from talaria.config.schema import ModelConfig, ReasoningParser, ToolParser
from talaria.gateway.errors import APIError
from talaria.gateway.openai_protocol import Endpoint, parse_request
from talaria.gateway.output_parser import ParsedOutput, assemble
from talaria.gateway.tools import ModelFormats, model_formats
from .fakes import MODEL, TemplateCatalog

QWEN3_CODER = ToolParser.QWEN3_CODER
SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    "get_time": {"type": "object", "properties": {}},
}

# ---- detection from the chat template ----------------------------------------------------------

# Qwen3.5's shape: the tools as JSON, calls rendered as XML (non-string values by Python's str or
# tojson), and a generation prompt that opens the reasoning.
QWEN35_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n'
    '<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n'
    '</function>\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + (message.content or '') }}
{%- for tool_call in message.tool_calls or [] %}
{%- set tool_call = tool_call.function %}
{{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
{%- for args_name, args_value in tool_call.arguments | items %}
{%- set args_value = args_value | tojson if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
{{- '<parameter=' + args_name + '>\n' + args_value + '\n</parameter>\n' }}
{%- endfor %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n<think>\n' }}{%- endif %}"""

# Qwen3-Coder's shape: the same calls, no reasoning.
QWEN3_CODER_TEMPLATE = (QWEN35_TEMPLATE.replace("<|im_start|>assistant\\n<think>\\n", "<|im_start|>assistant\\n"))

# A Llama-3.1-style prompt that mentions `<function=` (its custom-tool format) but renders no parameters.
LLAMA_FUNCTION_TAG_TEMPLATE = ("{{- 'Environment: ipython\\nReply as <function=name>{\"a\": 1}</function>' }}"
                               "{%- for m in messages %}{{ m.content }}{%- endfor %}")


class Template:
    """Stands in for the tokenizer: model_formats reads only its chat template's source."""

    def __init__(self, source: str | None) -> None:
        self.chat_template_source = source


def formats(source: str | None, tools: ToolParser = ToolParser.AUTO) -> ModelFormats:
    config = ModelConfig("m", "synthetic:", tool_parser=tools, reasoning_parser=ReasoningParser.AUTO)
    return model_formats(config, Template(source))


def test_auto_detects_the_xml_format():
    assert QWEN3_CODER_TEMPLATE != QWEN35_TEMPLATE
    assert formats(QWEN35_TEMPLATE) == ModelFormats(QWEN3_CODER, reasoning=True, template_tools=True)
    assert formats(QWEN3_CODER_TEMPLATE) == ModelFormats(QWEN3_CODER, reasoning=False, template_tools=True)
    assert formats(LLAMA_FUNCTION_TAG_TEMPLATE).tools is ToolParser.LLAMA3_JSON
    assert formats(QWEN35_TEMPLATE, ToolParser.HERMES).tools is ToolParser.HERMES  # explicit wins
    assert formats(None, QWEN3_CODER).tools is QWEN3_CODER


# ---- from the request to the parser ------------------------------------------------------------


TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
HISTORY = [{"role": "user", "content": "weather?"},
           {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
               "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.fixture(scope="module")
def qwen35() -> TemplateCatalog:
    return TemplateCatalog(QWEN35_TEMPLATE)


def test_a_chat_request_hands_the_parser_its_schemas_and_open_reasoning(qwen35):
    p = parse_request(Endpoint.CHAT, {"model": MODEL, "messages": HISTORY, "tools": TOOLS}, qwen35)
    prompt = qwen35.tok.decode(list(p.prompt_token_ids))
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert p.tool_format is QWEN3_CODER and p.reasoning and p.reasoning_open
    assert p.tool_schemas == SCHEMAS
    output = ("Rome now.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
              "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
    expected = ParsedOutput("", "Rome now.\n", [["get_weather", '{"city": "Rome", "days": 2}']])
    parser = p.output_parser()
    assert parser is not None
    events = [e for ch in output for e in parser.feed(ch)] + parser.finish()
    assert assemble(events) == p.parse_output(output) == expected  # streamed == whole


def test_a_constrained_answer_does_not_start_as_reasoning(qwen35):
    body = {"model": MODEL, "messages": HISTORY, "response_format": {"type": "json_object"}}
    p = parse_request(Endpoint.CHAT, body, qwen35)
    assert p.reasoning and not p.reasoning_open and p.sampling.grammar is not None
    assert p.parse_output('{"a": 1}') == ParsedOutput('{"a": 1}', None, [])


def test_a_forced_tool_choice_is_refused_until_xml_calls_can_be_constrained(qwen35):
    body = {"model": MODEL, "messages": HISTORY, "tools": TOOLS, "tool_choice": "required"}
    with pytest.raises(APIError) as e:
        parse_request(Endpoint.CHAT, body, qwen35)
    assert e.value.status == 400 and e.value.param == "tool_choice" and "qwen3_coder" in str(e.value)
