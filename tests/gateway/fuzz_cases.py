"""The requests tests/gateway/test_fuzz_live.py sends: plausible bodies for each completion endpoint,
and the mutations that spoil them, each tagged with what docs/api.md says of it (OK: served;
REFUSED: a 4xx; EITHER: a 200, or a 4xx naming the field). EITHER is only for what the docs leave
open (a token id that is in one model's vocabulary and not another's, a body's encoding, headers
the docs do not mention); a value the docs accept only in some bodies (a forced tool choice beside
a JSON format) is tagged in the case's own body (`in_context`)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from typing import Any

from hypothesis import strategies as st

OK, REFUSED, EITHER = "ok", "refused", "either"  # what docs/api.md says of a mutation
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES, COUNT = "/v1/messages", "/v1/messages/count_tokens"
PATHS = [CHAT] * 3 + [COMPLETIONS] * 2 + [MESSAGES] * 2 + [MESSAGES + "?beta=true", COUNT]
MODELS = ["tiny-llama"] * 3 + ["tiny-qwen3"] * 3 + ["smollm2"] * 2  # the tiny ones answer in tens of ms
NAN, INF = float("nan"), float("inf")
SURROGATE = "\ud800"  # sent as the JSON escape "\ud800": valid JSON, not valid Unicode
BIG_PROMPT = "hello " * 50_000  # 300 KB: over every served model's context
RECOVERY_S = 180  # a worker that died is back within this
# Every case is a call of one session, but for the session values the mutations try: 300 one-call
# sessions in a minute are, to a node, 300 agents whose next calls admission reserves room for
# (talaria/routing/session_load.py), and a fresh node full of them answers a 429 to the next.
SESSION = "fuzz"


class Raw(str):
    """JSON text sent as written (deep nesting, numbers Python would not print)."""


def dumps(value: Any) -> str:
    """JSON as a careless client writes it: NaN and Infinity as bare tokens, lone surrogates escaped."""
    if isinstance(value, Raw):
        return value
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


def unparsable(value: Any) -> bool:
    """The gateway's JSON parser refuses the whole body for it: NaN or Infinity, a number literal past
    a float's range (`1e400`), an integer past Python's 4,300 digits, nesting past its depth."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if not isinstance(value, Raw):
        return False
    try:
        return len(value) > 4000 or math.isinf(float(value))
    except ValueError:
        return False


def deep(n: int) -> Raw:
    return Raw("[" * n + "]" * n)


# ---- plausible bodies ----------------------------------------------------------------------------

TEXT = st.one_of(st.sampled_from(["Hello", "Say hi.", "What is 2+2?", "Name a city.", "Write a haiku"]),
                 st.text(max_size=30))
WORD = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": CITY}}]
CHAT_CHOICES = ["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}]
MSG_TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": CITY}]
MSG_CHOICES = [{"type": "auto"}, {"type": "none"}, {"type": "any"}, {"type": "tool", "name": "get_weather"},
               {"type": "any", "disable_parallel_tool_use": True}]
CHAT_HISTORIES = [[], [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
                  [{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]]
MSG_HISTORIES = [[], [{"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                                        {"type": "text", "text": "Hello!"}]}],
                 [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                     "input": {"city": "Paris"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C",
                                                "cache_control": {"type": "ephemeral"}}]}]]
OPENAI_SAMPLING = {
    "temperature": st.one_of(st.just(0), st.floats(0.05, 2.0)), "top_p": st.floats(0.05, 1.0),
    "top_k": st.sampled_from([-1, 0, 1, 5, 50]), "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(WORD, st.lists(WORD, min_size=1, max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, 511), max_size=4),
    "ignore_eos": st.booleans(), "session_id": st.just(SESSION),
    "user": TEXT, "n": st.just(1), "presence_penalty": st.just(0), "frequency_penalty": st.just(0.0),
    "logit_bias": st.just({}), "metadata": st.just({"k": "v"}),
}


@st.composite
def openai_body(draw, path: str, model: str) -> dict:
    body: dict[str, Any] = {"model": model}
    if path == CHAT:
        system = draw(st.sampled_from([[], [{"role": "system", "content": "Be brief."}],
                                       [{"role": "developer", "content": "Answer in French."}]]))
        parts = st.lists(st.builds(lambda t: {"type": "text", "text": t}, TEXT), min_size=1, max_size=3)
        body["messages"] = system + draw(st.sampled_from(CHAT_HISTORIES)) + [
            {"role": "user", "content": draw(st.one_of(TEXT, parts))}]
        if draw(st.integers(0, 3)) == 0:
            body |= {"tools": CHAT_TOOLS, "tool_choice": draw(st.sampled_from(CHAT_CHOICES))}
        elif draw(st.integers(0, 5)) == 0:
            body["response_format"] = {"type": "json_object"}
    else:
        ids = st.lists(st.integers(0, 511), min_size=1, max_size=8)
        text = st.text(min_size=1, max_size=30)
        batch = st.one_of(st.lists(text, min_size=1, max_size=1), st.lists(ids, min_size=1, max_size=1))
        body["prompt"] = draw(st.one_of(text, ids, batch))
    key = "max_completion_tokens" if path == CHAT and draw(st.booleans()) else "max_tokens"
    body[key] = draw(st.integers(1, 4))
    body |= draw(st.fixed_dictionaries({}, optional=OPENAI_SAMPLING))
    if draw(st.booleans()):
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
    return body


@st.composite
def messages_body(draw, path: str, model: str) -> dict:
    blocks = st.lists(st.builds(lambda t: {"type": "text", "text": t}, TEXT), min_size=1, max_size=3)
    body: dict[str, Any] = {"model": model, "messages": draw(st.sampled_from(MSG_HISTORIES)) + [
        {"role": "user", "content": draw(st.one_of(TEXT, blocks))}]}
    if path != COUNT or draw(st.booleans()):
        body["max_tokens"] = draw(st.integers(1, 4))
    body |= draw(st.fixed_dictionaries({}, optional={
        "system": st.one_of(TEXT, blocks), "temperature": st.one_of(st.just(0), st.floats(0.05, 1.0)),
        "top_p": st.floats(0.05, 1.0), "top_k": st.integers(0, 50), "stop_sequences": st.lists(WORD, max_size=16),
        "metadata": st.just({"user_id": f"user_ab12_account_x_session_{SESSION}"}),
        "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}])}))
    if path != COUNT and draw(st.booleans()):
        body["stream"] = True
    if draw(st.integers(0, 3)) == 0:
        body |= {"tools": MSG_TOOLS, "tool_choice": draw(st.sampled_from(MSG_CHOICES))}
    elif draw(st.integers(0, 5)) == 0:
        body["output_config"] = {"format": {"type": "json_schema", "schema": CITY}}
    return body


# ---- mutations, tagged from docs/api.md ----------------------------------------------------------

@dataclass(frozen=True)
class Mutation:
    kind: str  # "set" (body[key] = value), "header" (value None: remove it), "raw" (the bytes), "body", "query"
    key: str
    value: Any
    tag: str  # OK, REFUSED or EITHER
    name: str | None = None  # what a 400 must name, when not the key ("": nothing)

    @property
    def field(self) -> str | None:
        """What a 400 must name; None when the body is refused whole (the JSON parser's: NaN, Infinity, a
        number past a float's range, past its depth or digits)."""
        if unparsable(self.value) or self.kind not in ("set", "header"):
            return None
        return self.key if self.name is None else self.name or None

    def __repr__(self) -> str:
        shown = self.value if self.kind == "raw" or isinstance(self.value, bytes) else dumps(self.value)
        shown = shown if len(str(shown)) < 80 else f"{str(shown)[:40]}...({len(str(shown))} chars)"
        return f"{self.kind}:{self.key}={shown}[{self.tag}]"


def fn(**function: Any) -> dict:
    return {"type": "function", "function": function}


def said(content: Any) -> list[dict]:
    return [{"role": "user", "content": content}]


def _table(kind: str, rows: dict[str, list[tuple[Any, str]]], name: str | None = None) -> list[Mutation]:
    return [Mutation(kind, key, value, tag, name) for key, values in rows.items() for value, tag in values]


O, R, E = OK, REFUSED, EITHER
NONSENSE = {"type": "nonsense"}  # a schema no grammar enforces
TOP_P = [(1, O), (1e-300, O), (5e-324, O), (0, R), (-0.0, R), (1.0000001, R), (NAN, R), (1e300, R), ("0.5", R), (-1, R)]
PENALTY = [(0, O), (-0.0, O), (1e-300, R), (0.5, R), (-2, R), (1e300, R), (NAN, R), ("0", R)]
OPENAI = _table("set", {
    "temperature": [(0, O), (-0.0, O), (2, O), (None, O), (2.0000001, R), (1e300, R), (-1e-300, R), (1e-300, O),
                    (5e-324, O), (1e-30, O), (NAN, R), (INF, R), (-INF, R), ("1", R), (True, R), ([], R), ({}, R)],
    "top_p": TOP_P, "presence_penalty": PENALTY, "frequency_penalty": PENALTY,
    "top_k": [(-1, O), (0, O), (1, O), (2**20, O), (2**20 + 1, R), (2**31, R), (2**70, R), (-2, R), (-(2**70), R), (1.5, R), ("5", R), (1e300, R)],
    "seed": [(0, O), (2**63 - 1, O), (-1, O), (-(2**63), O), (2**64 - 1, O), (2**64, R), (-(2**63) - 1, R),
             (2**70, R), (-(2**70), R), (Raw("9" * 5000), R), (1.5, R), ("7", R), (True, R), (1e300, R), (NAN, R)],
    "max_tokens": [(0, R), (-1, R), (1.5, R), ("2", R), (True, R), (1e300, R), (2**70, R), (NAN, R), ([], R),
                   (Raw("1e400"), R), (2.0, R)],
    "n": [(1, O), (2, R), (0, R), (-1, R), (2**70, R), (1.0, R), ("1", R)],
    "stop": [("x", O), (["a", "b", "c", "d"], O), ([], O), (["x" * 10000], O), (["🦜", "ß"], O), (["\x00"], O),
             (["a"] * 5, R), ("", R), ([""], R), ([123], R), (123, R), ({"a": 1}, R), ([SURROGATE], R), ("\udfff", R),
             ([str(i) for i in range(1000)], R)],
    "stop_token_ids": [([], O), ([0, 1, 2], O), (list(range(64)), O), (list(range(65)), R), (list(range(500)), R),
                       ([511], O), ([512], E), ([-1], R),
                       ([2**70], R), ([1.5], R), ("1", R), ([True], R), (3, R)],
    "ignore_eos": [(True, O), ("yes", R), (1, R)],
    "stream": [("true", R), (1, R), ([], R)],
    "stream_options": [("x", R), ({"include_usage": "yes"}, R), (5, R)],
    "session_id": [("x" * 256, O), ("🦜 session", O), ("", R), ("x" * 257, R), (5, R), (SURROGATE, R)],
    "logit_bias": [({}, O), ({"1": 5}, R), ({SURROGATE: 1}, R)],
    "user": [(SURROGATE, R)],  # ignored, but a string that is not Unicode is refused wherever it is
})
CHAT_ONLY = _table("set", {
    "logprobs": [(False, O), (True, R), (1, R)], "top_logprobs": [(0, O), (2, R)],
    "max_completion_tokens": [(2, O), (0, R), ("2", R), (2**70, R)],
    "response_format": [({"type": "text"}, O), ({"type": "json_object"}, O), ({"type": "xml"}, R), ("json", R),
                        ({"type": "json_schema"}, R), ({"type": "json_schema", "json_schema": {"schema": NONSENSE}}, R),
                        ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, O)],
    "tools": [("x", R), ([fn(name="bad name!")], R), ([fn(name="a")] * 2, R), ([fn(name="x" * 65)], R), ([], E),
              ([fn(name="f", parameters=NONSENSE)], E), ([fn(name="f", parameters="x")], R),
              ([{"type": "code_interpreter"}], R), ([fn(name=SURROGATE)], R),
              ([fn(name="f", description=SURROGATE)], R)],
    "tool_choice": [("none", O), ("auto", O), ("required", O), ("sometimes", R), (42, R),
                    ({"type": "function", "function": {"name": "nope"}}, R)],
    "parallel_tool_calls": [(False, O), ("x", R)],
    "messages": [([], R), ("hi", R), ([None], R), ([[]], R), ([{"role": "robot", "content": "x"}], R),
                 ([{"content": "x"}], R), (said(5), R), ([{"role": "user"}], R),
                 ([{"role": "tool", "content": "x"}], R), (said([{"type": "text", "text": 5}]), R),
                 (said([{"type": "image_url", "image_url": {"url": "data:,"}}]), R),
                 (said({"a": 1}), R), ([{"role": "assistant", "content": None, "tool_calls": [{"id": 1}]}], R),
                 (said(BIG_PROMPT), R), (said([deep(50)]), R), (said(""), O),
                 ([{"role": "user", "content": "hi", "name": "bob", "x": [1]}], O),
                 ([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}], O),
                 (said([]), O), ([{"role": "system", "content": "x"}], O), (said(SURROGATE), R), (said("a\udc00b"), R),
                 (said([{"type": "text", "text": "\udfff"}]), R)],
})
COMPLETIONS_ONLY = _table("set", {
    "echo": [(False, O), (True, R)], "best_of": [(1, O), (2, R), (0, R)], "suffix": [("", O), ("x", R)],
    "logprobs": [(0, O), (1, R), (True, R)],
    "prompt": [([[1, 2]], O), ("", R), ([], R), ([-1], R), ([2**70], R), ([512], E), (["a", "b"], R), ([["a"]], R),
               (5, R), (None, R), ([1.5], R), ([True], R), ({"text": "x"}, R), (BIG_PROMPT, R),
               (SURROGATE, R), ("a\udc00b", R), ([SURROGATE], R)],
})
ANTHROPIC = _table("set", {
    "temperature": [(0, O), (-0.0, O), (1, O), (1.5, R), (1e-300, O), (5e-324, O), (NAN, R), (INF, R), ("0", R),
                    (1e300, R), (-1e-300, R)],
    "top_p": TOP_P, "top_k": [(0, O), (1, O), (40, O), (2**20, O), (-1, R), (2**20 + 1, R), (2**70, R), (1.5, R),
                              ("5", R), (-2, R)],
    "max_tokens": [(0, R), (-1, R), ("4", R), (1.5, R), (None, R), (True, R), (NAN, R)],
    "stop_sequences": [(["a"] * 16, O), (["x" * 10000], O), ([], O), ([str(i) for i in range(17)], R), ([""], R),
                       ("x", R), ([5], R), ([SURROGATE], R)],
    "stream": [("yes", R), (1, R)],
    "system": [("", O), ([{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}], O),
               ("x-anthropic-billing-header: cc_version=1; cch=abc;\nBe brief.", O), (5, R), ([{"type": "image"}], R),
               ([{"type": "text"}], R), ({"type": "text", "text": "x"}, R), (SURROGATE, R)],
    "metadata": [({}, O), ({"user_id": "user_x_session_abc"}, O), ({"user_id": "user_a_session_" + "x" * 300}, O),
                 ("x", R), ({"user_id": 5}, R), ({"user_id": SURROGATE}, R),
                 ({"user_id": "u_session_" + SURROGATE}, R)],
    "thinking": [({"type": "enabled", "budget_tokens": 1024}, O), ({"type": "disabled"}, O), ({"type": "sometimes"}, R),
                 ("on", R), ({"type": "enabled", "budget_tokens": "lots"}, R)],
    "tools": [([{"name": "t", "input_schema": {"type": "object"}}], O), ([{"name": "bad name", "input_schema": {}}], R),
              ([{"type": "web_search_20250305", "name": "web_search"}], R), ("x", R), ([{"name": "t"}], R),
              ([{"name": "t", "input_schema": NONSENSE}], E), ([{"name": SURROGATE, "input_schema": {}}], R)],
    "tool_choice": [({"type": "any"}, O), ({"type": "none"}, O), ({"type": "magic"}, R), ("auto", R),
                    ({"type": "tool", "name": "nope"}, R), ({"type": "auto", "disable_parallel_tool_use": "x"}, R)],
    "output_config": [({}, O), ("x", R), ({"format": {"type": "json_schema"}}, R),
                      ({"format": {"type": "json_schema", "schema": {"type": "object"}}}, O)],
    "messages": [([], R), ([{"role": "system", "content": "x"}], O), (said(5), R),
                 (said([{"type": "image", "source": {}}]), R),
                 (said([{"type": "document"}]), R), (said([{"type": "wat"}]), R),
                 (said([{"type": "tool_use", "id": "a", "name": "b", "input": {}}]), R),
                 (said([{"type": "tool_result", "tool_use_id": "t1", "content": 5}]), R),
                 (said([{"type": "tool_result", "tool_use_id": "t1", "content": "42", "is_error": True}]), O),
                 (said([{"type": "tool_result", "tool_use_id": "t1", "content": "42", "is_error": "yes"}]), R),
                 ([{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                                     "input": {"x": deep(200)}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a"}]}], E),
                 (said([]), E), (said(SURROGATE), R), (said([{"type": "text", "text": "\udfff"}]), R)],
}) + [Mutation("set", "messages", said(BIG_PROMPT), R, "prompt")]  # Anthropic's words: "prompt is too long"
EVERYWHERE = _table("set", {
    "foo": [("bar", O)], "__proto__": [({}, O)], "x" * 1000: [(1, O)], "unicode_🦜": [("ß", O)],
    "nested": [(deep(100), O), (deep(100_000), E)], "nan_token": [(NAN, R)],
    "huge_int": [(Raw("9" * 5000), E)], "pad": [("x" * 9_000_000, R)],
    "model": [("no-such-model", R), (5, R), ("", R), (SURROGATE, R), ("SMOLLM2", R), (None, R), (["tiny-llama"], R)],
}) + [Mutation("set", SURROGATE, 1, R, "\\ud800"), Mutation("set", "big_exp", Raw("1e999999"), R, "")] + \
    _table("body", {"body": [([], R), ("str", R), (1, R), (None, R), (True, R), ("wrap", R)]}) + _table("raw", {
    "raw": [("invalid_utf8", R), ("overlong", R), ("utf8_surrogate", R), ("truncated", R), ("empty", R), ("blank", R),
            ("trailing_garbage", R), ("nul", R), ("bom", E), ("utf16", E), ("utf16be", E), ("utf32", E),
            ("trailing_newline", O), ("raw_utf8", O), ("chunked", O)]}) + _table("header", {
    "content-type": [(None, E), ("text/plain", E), ("application/json; charset=latin-1", E), ("a/b/c;;;", E),
                     ("application/x-www-form-urlencoded", E), ("multipart/form-data; boundary=x", E),
                     ("application/json; charset=utf-8", O), ("APPLICATION/JSON", O)],
    "authorization": [("Bearer junk", O), ("Basic Zm9vOmJhcg==", O), ("", O), ("Bearer " + "x" * 4000, O),
                      (b"Bearer \xff\xfe", O)],
    "x-api-key": [("junk", O), ("", O)], "anthropic-version": [("2023-06-01", O), ("bogus", O), ("", O)],
    "anthropic-beta": [("prompt-caching-2024-07-31,junk", O), ("x" * 2000, O)],
    "accept": [("text/event-stream", O), ("application/xml", O)], "content-encoding": [("gzip", E), ("br", E)],
    "x-talaria-forwarded": [("junk", O)],
}) + _table("header", {"x-session-id": [("abc", O), ("x" * 256, O), ("", O), (b"\xe9t\xe9", O), ("a b/c?d", O),
                                        ("x" * 257, E)]}, name="session") + [Mutation("query", "query", "x=%ff&&=", O)]
RAW = {  # the body's bytes, spoiled or re-encoded
    "invalid_utf8": lambda b: b'{"junk":"\xff\xc3(",' + b[1:], "overlong": lambda b: b'{"junk":"\xc0\xaf",' + b[1:],
    "utf8_surrogate": lambda b: b'{"junk":"\xed\xa0\x80",' + b[1:],
    "raw_utf8": lambda b: '{"junk":"é🦜",'.encode() + b[1:],
    "truncated": lambda b: b[: len(b) // 2], "empty": lambda b: b"", "blank": lambda b: b" \n\t ",
    "trailing_garbage": lambda b: b + b"xyz", "nul": lambda b: b + b"\x00", "trailing_newline": lambda b: b + b"\r\n",
    "bom": lambda b: b"\xef\xbb\xbf" + b, "utf16": lambda b: b.decode().encode("utf-16"),
    "utf16be": lambda b: b.decode().encode("utf-16-be"), "utf32": lambda b: b.decode().encode("utf-32"),
    "chunked": lambda b: b,
}
POOLS = {CHAT: OPENAI + CHAT_ONLY + EVERYWHERE, COMPLETIONS: OPENAI + COMPLETIONS_ONLY + EVERYWHERE,
         MESSAGES: ANTHROPIC + EVERYWHERE, COUNT: ANTHROPIC + EVERYWHERE}


@dataclass(frozen=True)
class Case:
    path: str
    headers: dict[str, str | bytes]
    body: bytes
    mutations: tuple[Mutation, ...]
    chunked: bool = False

    @property
    def tags(self) -> set[str]:
        return {m.tag for m in self.mutations}

    def curl(self) -> str:
        shown = {k: v.decode("latin-1") if isinstance(v, bytes) else v for k, v in self.headers.items()}
        headers = " ".join(f"-H '{k}: {v}'" for k, v in shown.items())
        if len(self.body) > 3000 or not self.body.isascii() or b"'" in self.body:
            more = "..." if len(self.body) > 600 else ""
            body = f"{self.body[:600]!r}{more} ({len(self.body)} bytes; --data-binary @file)"
        else:
            body = f"--data-binary '{self.body.decode()}'"
        return f"curl -sS \"$URL{self.path}\" {headers} {body}"


def for_count(m: Mutation) -> Mutation:
    """count_tokens takes the body "without max_tokens (and without stream)"; it counts a prompt over the context."""
    if m.key in ("max_tokens", "stream") and m.tag == REFUSED:
        return replace(m, tag=EITHER)
    if m.key == "messages" and m.value and isinstance(m.value[0], dict) and m.value[0].get("content") is BIG_PROMPT:
        return replace(m, tag=OK)
    return m


def forces_a_tool(body: dict, endpoint: str) -> bool:
    """The body forces a tool call: chat's tool_choice "required" or a named function, the Messages
    API's "any" or "tool", with tools to call."""
    choice = body.get("tool_choice")
    if endpoint == CHAT:
        return bool(body.get("tools")) and (choice == "required" or isinstance(choice, dict))
    return bool(body.get("tools")) and isinstance(choice, dict) and choice.get("type") in ("any", "tool")


def asks_json(body: dict, endpoint: str) -> bool:
    """The body asks for a JSON output format (chat's response_format, the Messages API's output_config.format)."""
    if endpoint == CHAT:
        fmt = body.get("response_format")
        return isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema")
    config = body.get("output_config")
    return isinstance(config, dict) and config.get("format") is not None


def in_context(m: Mutation, body: dict, endpoint: str) -> Mutation:
    """An accepted value that the rest of the body makes a 400, as docs/api.md says: a forced tool
    choice with a JSON format ("Forcing a tool and a JSON response_format together is a 400"), a
    forced choice with no tools to call, a named tool that is not among the tools."""
    if m.tag != OK or m.kind != "set":
        return m
    conflict = forces_a_tool(body, endpoint) and asks_json(body, endpoint)
    choice = body.get("tool_choice")
    if m.key in ("response_format", "output_config", "tools") and conflict:
        return replace(m, tag=REFUSED)
    if m.key == "tool_choice" and (m.value == "required" or isinstance(m.value, dict) and m.value.get("type") == "any"):
        return replace(m, tag=REFUSED) if conflict or not body.get("tools") else m
    if m.key == "tools" and endpoint != CHAT and isinstance(choice, dict) and choice.get("type") == "tool":
        return replace(m, tag=REFUSED) if choice.get("name") not in {t.get("name") for t in m.value} else m
    return m


@st.composite
def cases(draw) -> Case:
    path, model = draw(st.sampled_from(PATHS)), draw(st.sampled_from(MODELS))
    endpoint = path.partition("?")[0]
    body: Any = draw((openai_body if endpoint in (CHAT, COMPLETIONS) else messages_body)(endpoint, model))
    # Mutations are picked uniformly, from a generator seeded by the body: hypothesis draws lean on a
    # list's first entries, and its examples share prefixes (a seed drawn first repeats).
    rnd = random.Random(f"{draw(st.integers(0, 2**32))}:{dumps(body)}")
    count = rnd.choices([0, 1, 2, 3], weights=[4, 4, 2, 1])[0]
    chosen = {(m.kind, m.key): m for m in rnd.choices(POOLS[endpoint], k=count)}
    if endpoint == COUNT:
        chosen = {k: for_count(m) for k, m in chosen.items()}
    if "max_completion_tokens" in body and ("set", "max_tokens") in chosen:  # "the latter wins when both are sent"
        chosen["set", "max_tokens"] = replace(chosen["set", "max_tokens"], tag=EITHER)
    mutations = tuple(chosen.values())
    headers: dict[str, str | bytes] = {"content-type": "application/json"}
    raw, query = None, ""
    for m in mutations:
        if m.kind == "set":
            body[m.key] = m.value
        elif m.kind == "header" and m.value is None:
            headers.pop(m.key, None)
        elif m.kind == "header":
            headers[m.key] = m.value
        elif m.kind == "raw":
            raw = m.value
        elif m.kind == "query":
            query = ("&" if "?" in path else "?") + m.value
    mutations = tuple(in_context(m, body, endpoint) for m in mutations)
    for m in mutations:
        if m.kind == "body":
            body = [body] if m.value == "wrap" else m.value
    metadata = body.get("metadata") if isinstance(body, dict) else None
    own = isinstance(body, dict) and ("session_id" in body or isinstance(metadata, dict) and "user_id" in metadata)
    if isinstance(body, dict) and not own and ("header", "x-session-id") not in chosen:
        headers["x-session-id"] = SESSION
    data = dumps(body).encode()
    return Case(path + query, headers, RAW[raw](data) if raw else data, mutations, raw == "chunked")


# ---- one exchange, judged ------------------------------------------------------------------------
