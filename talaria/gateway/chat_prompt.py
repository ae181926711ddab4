"""A conversation made into a model's prompt: the chat template, the tools, the grammar, the ids.

Both chat APIs end here once they have their messages in one shape (OpenAI's: roles, string
content, assistant `tool_calls`, `tool` messages): the OpenAI protocol directly, the Anthropic
Messages API after converting its content blocks. What it decides: how the model sees the tools
(talaria/gateway/tools.py), whether and how its output is parsed, the grammar a forced choice or a
JSON format needs (talaria/gateway/grammar.py), and the prompt's ids, tokenized from the last prompt
of the same conversation when there is one (talaria/gateway/prompt_cache.py). The client's text is
tokenized as text: a special token's text in it never becomes a control token, only the template's
markup does (`Tokenizer.apply_chat_template` quotes it, `encode_prompt` reads the quotes).

Two rules keep an agent's next prompt an extension of its last, so its prefix stays cached:
- **System turns inside the conversation** (Claude Code's environment block after its first user
  turn, a late `developer` message) are rendered where they stand. A template that takes a system
  message only first — one that refuses a later one (Qwen3.5's "System message must be at the
  beginning"), drops it, or moves it to the top — gets each later system message as a `user`
  message in its place instead: merged into the first one, it would change the prompt's start on
  every call that adds one. Which templates those are is found by rendering a probe once per
  tokenizer (`_system_turns_in_place`).
- **Reasoning turned off** (`thinking: false`, the Messages API's `{"type": "disabled"}`) on a
  reasoning model ends the prompt with an empty reasoning section, `<think>\n\n</think>\n\n` (what
  Qwen3's and Qwen3.5's templates write for `enable_thinking=false`; a `<think>` the generation
  prompt opened is closed rather than repeated), and the output is read as the answer. Only the
  generation prompt changes: the conversation before it is the same text either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from talaria.config.schema import ToolParser
from talaria.gateway.errors import APIError
from talaria.gateway.grammar import tool_call_grammar
from talaria.gateway.json_scan import WHITESPACE
from talaria.gateway.output_parser import END_THINK, THINK
from talaria.gateway.prompt_cache import PromptCache
from talaria.gateway.tools import ToolChoice, Tools, model_formats, template_messages
from talaria.models.errors import ChatTemplateError
from talaria.routing.continuity import message_chain

if TYPE_CHECKING:
    from talaria.gateway.openai_protocol import ModelCatalog
    from talaria.models.tokenizer import Tokenizer

NO_REASONING = f"{THINK}\n\n{END_THINK}\n\n"  # an empty reasoning section: the answer follows
PROBE = ("talaria-probe-first", "talaria-probe-user", "talaria-probe-late")  # system, user, system texts


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
                      tools_param: str = "tools", format_param: str = "response_format",
                      thinking: bool = True) -> ChatPrompt:
    """The prompt of a validated conversation; raises APIError 400 for what the model cannot do.
    `thinking` False: a reasoning model answers without reasoning (the module docstring)."""
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
    shown, offered = template_messages(_late_system_turns(messages, tokenizer), tools, formats)
    try:
        text = tokenizer.apply_chat_template(shown, add_generation_prompt=True, tools=offered)
    except (ChatTemplateError, TemplateError) as e:  # e.g. "roles must alternate user/assistant"
        raise APIError.invalid(f"the model's chat template rejected the messages: {e}", "messages") from e
    reasoning = formats.reasoning
    if reasoning and not thinking:
        end = text.rstrip(WHITESPACE)
        text = (end.removesuffix(THINK) if end.endswith(THINK) else text) + NO_REASONING
        reasoning = False
    if prompts is not None:
        ids = prompts.encode(tokenizer, model, message_chain(messages), text)
    else:
        ids = tokenizer.encode_prompt(text).ids
    # a grammar applies from the first token, so a constrained answer never starts inside reasoning
    opened = reasoning and grammar is None and text.rstrip(WHITESPACE).endswith(THINK)
    return ChatPrompt(ids, tool_format, reasoning, grammar, schemas, opened)


def _late_system_turns(messages: list[dict[str, Any]], tokenizer: Tokenizer) -> list[dict[str, Any]]:
    """The conversation with its later system messages as user messages in place, for a template
    that takes a system message only first (the module docstring); unchanged otherwise."""
    if not any(m["role"] == "system" for m in messages[1:]) or _system_turns_in_place(tokenizer):
        return messages
    return [messages[0]] + [{**m, "role": "user"} if m["role"] == "system" else m for m in messages[1:]]


@lru_cache(maxsize=64)
def _system_turns_in_place(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer's template renders a system message after a user message, after it:
    neither refused, nor dropped, nor moved ahead of it. Rendered once per tokenizer (a pure function
    of its immutable template)."""
    first, user, late = PROBE
    probe = [{"role": "system", "content": first}, {"role": "user", "content": user},
             {"role": "system", "content": late}]
    try:
        text = tokenizer.apply_chat_template(probe, add_generation_prompt=True)
    except (ChatTemplateError, TemplateError):
        return False
    return text.count(late) == 1 and text.find(user) < text.find(late)
