"""`talaria replay` through click's CliRunner against the real gateway over loopback HTTP, with
FakeEchoSupervisor behind it (`serve_over_loopback`).

The echo groups answer with the prompt's first bytes, so a synthesized prompt that reuses the
previous output can be checked byte for byte. Gap checks use the real clock with a wide tolerance.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
from click.testing import CliRunner

from talaria.cli.main import cli
from talaria.contracts.trace import TraceCall, write_trace
from tests.conftest import free_port
from tests.gateway.fakes import MODEL, FakeEchoGroup
from tests.gateway.fakes import serve_over_loopback as serve

SUMMARY_KEYS = {"sessions", "calls", "errors", "wall_s", "sct_sum_s", "sct_p50_s", "sct_p95_s", "ttft_p50_s",
                "ttft_p95_s"}


@pytest.fixture
def group() -> FakeEchoGroup:
    return FakeEchoGroup("hot0")


@pytest.fixture
def url(group: FakeEchoGroup) -> Iterator[str]:
    with serve(group) as u:
        yield u


def call(session: str, index: int, prompt: int, reused: int, completion: int, gap: float = 0.0,
         body: dict | None = None) -> TraceCall:
    return TraceCall(session, index, MODEL, prompt, reused, completion, gap, body=body)


def trace_file(tmp_path: Path, calls: list[TraceCall]) -> Path:
    path = tmp_path / "trace.jsonl"
    with path.open("w") as f:
        write_trace(calls, f)
    return path


def run(*args: str):
    return CliRunner().invoke(cli, ["replay", *args])


def prompts(group: FakeEchoGroup, session: str) -> list[str]:
    """The prompts the server saw for `session`, in arrival order (the byte tokenizer: one token a byte)."""
    return [bytes(c.prompt_token_ids).decode() for c in group.calls if c.session_id == session]


# a: 40 fresh; +8 out; then 60 reusing 48 (prompt + output) + 12 new; then a rewrite keeping 20 of 60
TWO_SESSIONS = [call("a", 0, 40, 0, 8), call("b", 0, 25, 0, 5), call("a", 1, 60, 48, 6),
                call("b", 1, 30, 25, 3), call("a", 2, 30, 20, 4)]


def test_two_sessions_replay_in_order_with_the_trace_token_structure(tmp_path, group, url):
    out = tmp_path / "out" / "replay.json"
    result = run("--url", url, "--trace", str(trace_file(tmp_path, TWO_SESSIONS)), "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "sessions done: 2/2" in result.stderr
    assert "SCT p95" in result.stdout and "TTFT p50 (schedule-aware)" in result.stdout

    assert len(group.calls) == 5 and len(group.completed) == 5
    a0, a1, a2 = prompts(group, "a")
    assert [len(p) for p in (a0, a1, a2)] == [40, 60, 30]
    assert a1[:48] == a0 + a0[:8]  # the previous prompt, then the previous response as received (the echo)
    assert a2[:20] == a1[:20] and a2[20] != a1[20]  # the common prefix is exactly the reused part
    b0, b1 = prompts(group, "b")
    assert b1[:25] == b0 and len(b1) == 30
    assert a0 != b0  # each session's new text is its own
    for c in group.calls:
        assert c.sampling.ignore_eos and c.sampling.temperature == 0
    assert [c.sampling.max_tokens for c in group.calls if c.session_id == "a"] == [8, 6, 4]

    report = json.loads(out.read_text())
    assert set(report) == {"url", "trace", "gap_cap_s", "endpoint", "summary", "sessions"}
    assert set(report["summary"]) == SUMMARY_KEYS
    assert report["summary"]["calls"] == 5 and report["summary"]["errors"] == 0
    assert [s["session_id"] for s in report["sessions"]] == ["a", "b"]
    a = report["sessions"][0]["calls"]
    assert [c["index"] for c in a] == [0, 1, 2] and [c["text"] for c in a] == [a0[:8], a1[:6], a2[:4]]
    for prev, nxt in pairwise(a):
        assert nxt["intended_s"] >= prev["done_s"]  # closed loop: sent only after the previous response


def test_trace_bodies_are_sent_with_the_fixed_output_fields_forced(tmp_path, group, url):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 99,
            "temperature": 0.9}
    calls = [call("s", 0, 5, 0, 3, body={"model": MODEL, "prompt": "hello", "max_tokens": 99, "temperature": 1.5,
                                         "session_id": "other"}),
             call("s", 1, 9, 5, 2, body=chat)]
    result = run("--url", url + "/v1/", "--trace", str(trace_file(tmp_path, calls)))
    assert result.exit_code == 0, result.output
    first, second = group.calls
    assert bytes(first.prompt_token_ids) == b"hello"
    assert [c.session_id for c in group.calls] == ["s", "s"]
    assert [c.sampling.max_tokens for c in group.calls] == [3, 2]
    assert all(c.sampling.ignore_eos and c.sampling.temperature == 0 for c in group.calls)
    assert b"hi" in bytes(t for t in second.prompt_token_ids if t < 256)  # went through the chat template


def test_chat_endpoint_wraps_synthesized_prompts_in_a_user_message(tmp_path, group, url):
    result = run("--url", url, "--trace", str(trace_file(tmp_path, [call("s", 0, 12, 0, 2)])), "--endpoint", "chat")
    assert result.exit_code == 0, result.output
    sent = bytes(t for t in group.calls[0].prompt_token_ids if t < 256).decode()
    assert "user" in sent and len(sent) > 12  # the template's tokens around the 12 synthesized ones


def test_gaps_are_honoured_and_capped(tmp_path, group, url):
    # start offset 0.2 s, then a 0.3 s gap, then a 30 s gap capped at 0.4 s
    calls = [call("s", 0, 4, 0, 1, gap=0.2), call("s", 1, 6, 5, 1, gap=0.3), call("s", 2, 8, 7, 1, gap=30.0)]
    out = tmp_path / "r.json"
    started = time.monotonic()
    result = run("--url", url, "--trace", str(trace_file(tmp_path, calls)), "--gap-cap-s", "0.4", "--json", str(out))
    elapsed = time.monotonic() - started
    assert result.exit_code == 0, result.output
    assert 0.9 <= elapsed < 10.0  # 0.2 + 0.3 + 0.4 of waiting; nowhere near the uncapped 30 s
    c0, c1, c2 = json.loads(out.read_text())["sessions"][0]["calls"]
    tolerance = 0.5
    assert 0.3 - 0.01 <= c1["sent_s"] - c0["done_s"] < 0.3 + tolerance
    assert 0.4 - 0.01 <= c2["sent_s"] - c1["done_s"] < 0.4 + tolerance
    assert json.loads(out.read_text())["gap_cap_s"] == 0.4


def test_api_key_is_sent_and_a_refusal_is_one_clear_line(tmp_path):
    trace = str(trace_file(tmp_path, [call("s", 0, 4, 0, 1)]))
    group = FakeEchoGroup("hot0")
    with serve(group, api_key="sesame") as u:
        refused = run("--url", u, "--trace", trace)
        assert refused.exit_code == 1 and "pass its key with --api-key" in refused.output
        assert group.calls == []
        ok = run("--url", u, "--trace", trace, "--api-key", "sesame")
        assert ok.exit_code == 0, ok.output
        assert len(group.calls) == 1


def test_a_model_the_server_lacks_is_warned_about_and_counted(tmp_path, url):
    calls = [TraceCall("s", 0, "nope", 4, 0, 1, 0.0)]
    result = run("--url", url, "--trace", str(trace_file(tmp_path, calls)))
    assert result.exit_code == 0
    assert "does not list nope" in result.stderr and "1 call(s) failed" in result.stderr
    assert "HTTP 404" in result.stderr


def test_bad_trace_and_unreachable_url_fail_with_a_message(tmp_path, url):
    missing = run("--url", url, "--trace", str(tmp_path / "nope.jsonl"))
    assert missing.exit_code != 0 and "does not exist" in missing.output

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session": "s", "index": 0}\n')
    broken = run("--url", url, "--trace", str(bad))
    assert broken.exit_code == 1 and "bad trace" in broken.output and "missing model" in broken.output
    assert isinstance(broken.exception, SystemExit)  # a message, not a traceback

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert "has no calls" in run("--url", url, "--trace", str(empty)).output

    good = str(trace_file(tmp_path, [call("s", 0, 4, 0, 1)]))
    nobody = run("--url", f"http://127.0.0.1:{free_port()}", "--trace", good)
    assert nobody.exit_code == 1 and "cannot reach" in nobody.output
    assert isinstance(nobody.exception, SystemExit)
    scheme = run("--url", "127.0.0.1:8000", "--trace", good)
    assert scheme.exit_code == 1 and "not an http(s) URL" in scheme.output
