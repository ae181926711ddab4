"""Chat templates render with transformers' environment: helpers, whitespace control, sandbox."""

from __future__ import annotations

from datetime import datetime

import pytest

from talaria.models.chat_template import ChatTemplate
from talaria.models.errors import ChatTemplateError

USER = [{"role": "user", "content": "héllo <b>"}]


def test_helpers_and_special_tokens():
    template = ChatTemplate(
        "{{ bos_token }}{{ messages | tojson }}|{{ strftime_now('%Y-%m-%d') }}|{{ tools[0].name }}",
        {"bos_token": "<s>"}, now=lambda: datetime(2026, 1, 2))
    out = template.render(USER, tools=[{"name": "search"}])
    assert out == '<s>[{"role": "user", "content": "héllo <b>"}]|2026-01-02|search'  # no HTML escaping


def test_trim_and_lstrip_blocks_like_transformers():
    template = ChatTemplate("{% for m in messages %}\n  {% if m %}{{ m['content'] }}{% endif %}\n{% endfor %}", {})
    assert template.render(USER) == "héllo <b>"  # plain Jinja would give "\n  héllo <b>\n"


def test_generation_tag_and_loop_controls():
    source = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
              "{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}")
    assert ChatTemplate(source, {}).render(USER + USER) == "héllo <b>"


def test_sandbox_blocks_attribute_escapes():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(ChatTemplateError):
        template.render(USER)


def test_syntax_error_says_where():
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for %}", {})
