"""A model's Jinja chat template, rendered exactly as transformers renders it.

Same environment as ``transformers.utils.chat_template_utils``: an immutable sandbox (templates
from the Hub are untrusted code), ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, a
non-escaping ``tojson``, ``raise_exception``, ``strftime_now``, and the special tokens as variables.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from talaria.models.errors import ChatTemplateError


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): render the body as is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A compiled template plus the special-token strings it may reference (``bos_token``, ...)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None],
                 now: Callable[[], datetime] = datetime.now):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationTag, loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the model's chat template does not parse (line {e.lineno}: {e.message}); "
                                    "fix chat_template in tokenizer_config.json") from None
        self._special_tokens = dict(special_tokens)
        self.source = source  # the Jinja text: which tool-call and reasoning formats it writes

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text. Content given as OpenAI parts (``[{"type": "text", "text": ...}]``) is
        joined with newlines first, since most templates expect a string."""
        try:
            return self._template.render(
                messages=[_flatten(m) for m in messages],
                tools=list(tools) if tools else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected the conversation: {e}") from None


def _flatten(message: Mapping[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ChatTemplateError(f"message content part of type {kind!r} is not supported; send text parts only")
        texts.append(part.get("text", ""))
    return {**message, "content": "\n".join(texts)}
