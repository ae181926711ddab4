"""The request-shape corpus of the Messages API (tests/gateway/fixtures/messages/): requests as
clients of several generations send them — Claude Code 1.0, 2.0 and 2.1, and the anthropic SDK used
plainly — written by hand from their documented shapes (each file says so), with what a server must
make of them. Every one is parsed and rendered, on a template that takes system turns in place and
on one that takes a single system message (Qwen3.5's guard): its session is the one its user id
names, the texts the model must see are in the prompt in the order sent and those it must not see
are not, its tools are listed before the conversation except the deferred ones, and count_tokens
counts exactly the prompt. A new client generation is one more file here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from talaria.config.schema import ServerConfig
from talaria.gateway.anthropic_protocol import parse_messages

from .fakes import MODEL, FakeEchoSupervisor, TemplateCatalog
from .test_anthropic_conversation import REFUSING

CORPUS = sorted((Path(__file__).parent / "fixtures" / "messages").glob("*.json"))
SERVER = ServerConfig()


@pytest.fixture(scope="module", params=["in-place", "one-system"])
def catalog(request):
    if request.param == "in-place":
        return FakeEchoSupervisor(max_position=16384)
    return TemplateCatalog(REFUSING, max_position=16384)


def test_the_corpus_holds_every_shape_issue_37_names():
    """So that trimming a fixture cannot silently drop what these tests are for."""
    bodies = {p.stem: json.loads(p.read_text())["body"] for p in CORPUS}
    assert {"claude-code-1.0", "claude-code-2.0", "claude-code-2.1", "anthropic-sdk-python"} <= set(bodies)
    today = bodies["claude-code-2.1"]
    blocks = [b for m in today["messages"] if isinstance(m["content"], list) for b in m["content"]]
    assert [m["role"] for m in today["messages"]].count("system") == 2
    assert json.loads(today["metadata"]["user_id"])["session_id"]
    assert today["thinking"] == {"type": "adaptive", "display": "omitted"} and today["output_config"]["effort"]
    assert today["context_management"]["edits"][0]["type"].startswith("clear_thinking_")
    assert len(today["tools"]) == 12 and sum(bool(t.get("defer_loading")) for t in today["tools"]) == 1
    assert any(part.get("type") == "tool_reference" for b in blocks if b["type"] == "tool_result"
               for part in b["content"] if isinstance(b["content"], list))
    assert today["system"][0]["text"].startswith("x-anthropic-billing-header:")
    assert bodies["claude-code-1.0"]["metadata"]["user_id"].count("_session_") == 1


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_each_request_parses_and_renders(catalog, path):
    doc = json.loads(path.read_text())
    body, expect = doc["body"] | {"model": MODEL}, doc["expect"]
    m = parse_messages(body, catalog, SERVER)
    text = catalog.tokenizer(MODEL).decode(m.prompt_token_ids)
    assert m.session_id == expect["session"] and m.stream is body.get("stream", False)
    places = [text.find(s) for s in expect["shown"]]
    assert -1 not in places and places == sorted(places), (expect["shown"], places)
    assert not [s for s in expect["hidden"] if s in text]
    first = body["messages"][0]["content"]
    first_text = first if isinstance(first, str) else first[0]["text"]
    listing = text[:text.index(first_text)]  # the system prompt, with the tools it lists
    assert all(f'"name": "{name}"' in listing for name in expect["listed_tools"])
    assert not [name for name in expect["deferred_tools"] if f'"name": "{name}"' in listing]
    assert all(f'"name": "{name}"' in text for name in expect["deferred_tools"])  # loaded later on
    counted = parse_messages({k: v for k, v in body.items() if k not in ("max_tokens", "stream")}, catalog, SERVER,
                             count_only=True)
    assert counted.prompt_token_ids == m.prompt_token_ids
