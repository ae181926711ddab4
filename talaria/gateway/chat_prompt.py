"""A conversation made into a model's prompt: the chat template, the tools, the grammar, the ids.

Both chat APIs end here once they have their messages in one shape (OpenAI's: roles, string
content, assistant `tool_calls`, `tool` messages): the OpenAI protocol directly, the Anthropic
Messages API after converting its content blocks. What it decides: how the model sees the tools
(talaria/gateway/tools.py), whether and how its output is parsed, the grammar a forced choice or a
JSON format needs (talaria/gateway/grammar.py), and the prompt's ids, tokenized from the last prompt
of the same conversation when there is one (talaria/gateway/prompt_cache.py). The client's text is
tokenized as text: a special token's text in it never becomes a control token, only the template's
markup does (`Tokenizer.apply_chat_template` quotes it, `encode_prompt` reads the quotes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from talaria.config.schema import ToolParser
from talaria.gateway.errors import APIError
from talaria.gateway.grammar import tool_call_grammar
from talaria.gateway.json_scan import WHITESPACE
from talaria.gateway.output_parser import THINK
from talaria.gateway.prompt_cache import PromptCache
from talaria.gateway.tools import ToolChoice, Tools, model_formats, template_messages
from talaria.models.errors import ChatTemplateError
from talaria.routing.continuity import message_chain

if TYPE_CHECKING:
    from talaria.gateway.openai_protocol import ModelCatalog


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    ids: tuple[int, ...]
    tool_format: ToolParser | None  # parse tool calls of this format out of the output (None: don't)
    reasoning: bool  # the output starts with reasoning (<think>...</think>)
    grammar: str | None  # what the output must follow (a forced tool choice, a JSON format); None: free
    tool_schemas: dict[str, Any] | None = None  # the offered functions' parameter schemas by name (XML calls' types)
    reasoning_open: bool = False  # the prompt ends inside <think> (Qwen3.5's): the output starts as reasoning


def build_chat_prompt(catalog: ModelCatalog, model: str, messages: list[dict[str, Any]], tools: Tools | None,
                      response_grammar: str | None, prompts: PromptCache | None,
                      tools_param: str = "tools", format_param: str = "response_format") -> ChatPrompt:
    """The prompt of a validated conversation; raises APIError 400 for what the model cannot do."""
    tokenizer = catalog.tokenizer(model)
    formats = model_formats(catalog.config.model(model), tokenizer)
    tool_format, grammar, schemas = None, None, None
    if tools is not None and tools.choice is not ToolChoice.NONE:
        if formats.tools is None:
            raise APIError.invalid(f"model {model!r} does not call tools (its tool_parser is \"none\")", tools_param)
        tool_format = formats.tools
        schemas = {fn.name: fn.parameters for fn in tools.functions}
        if tools.forced:
            grammar = tool_call_grammar(formats.tools, tools.forced, tools.parallel and tools.named is None)
    if response_grammar is not None:
        if grammar is not None:
            raise APIError.invalid(f"a structured output format ({format_param}) cannot be enforced together with "
                                   "a forced tool choice (tool_choice); drop one of them", tools_param)
        grammar = response_grammar
    shown, offered = template_messages(messages, tools, formats)
    try:
        text = tokenizer.apply_chat_template(shown, add_generation_prompt=True, tools=offered)
    except (ChatTemplateError, TemplateError) as e:  # e.g. "roles must alternate user/assistant"
        raise APIError.invalid(f"the model's chat template rejected the messages: {e}", "messages") from e
    if prompts is not None:
        ids = prompts.encode(tokenizer, model, message_chain(messages), text)
    else:
        ids = tokenizer.encode_prompt(text).ids
    # a grammar applies from the first token, so a constrained answer never starts inside reasoning
    opened = formats.reasoning and grammar is None and text.rstrip(WHITESPACE).endswith(THINK)
    return ChatPrompt(ids, tool_format, formats.reasoning, grammar, schemas, opened)
