"""Fuzzing the completion endpoints of a real `talaria up` (the session's shared server).

Whatever a client sends — wrong types, extreme numbers, NaN tokens, lone surrogates, odd headers,
bodies in the wrong encoding — the answer is never a 5xx and never costs a worker its life: a bad
value is a 4xx in the endpoint's error shape that names the field, and a good request is served.

- The property test draws about 300 requests over /v1/chat/completions, /v1/completions,
  /v1/messages (also `?beta=true`) and /v1/messages/count_tokens: a plausible body (most of them,
  so that at least 100 reach generation) with up to three mutations, drawn uniformly from the
  endpoint's list. Each mutation is tagged from docs/api.md: OK (the docs accept it: the answer must
  be a 200), REFUSED (the docs refuse it: a 4xx) or EITHER (only where the docs leave it open: a
  200, or a 4xx naming the field). Every case is sent after the node is healthy; failures are
  collected, not shrunk (a shrink that crashes a worker waits for its restart), and listed together
  at the end, each with a curl that reproduces it.
- Regression tests, one request each, for the values that crashed a worker or answered a 500, each
  held to what the docs say of it: a seed past 64 bits is a 400 naming `seed` (a seed truncated to
  64 bits would be served); a temperature or top_p of 1e-300 is served, greedily (the same text as
  temperature 0); a lone surrogate is a 400 naming where it is; an accepted seed at either end of
  its range gives its own reproducible stream; a session id with a lone surrogate is refused, after
  which GET /talaria/telemetry still answers.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from tests.conftest import Server, wait_for
from tests.gateway.fuzz_cases import (
    CHAT,
    COMPLETIONS,
    COUNT,
    EITHER,
    MESSAGES,
    OK,
    RECOVERY_S,
    REFUSED,
    SURROGATE,
    Case,
    Mutation,
    cases,
    dumps,
)

pytestmark = pytest.mark.slow


def restarts(server: Server) -> int | None:
    """The node's worker restarts, all instances together; None when telemetry does not answer."""
    r = server.telemetry()
    return sum(i["restarts"] for i in r.json()["instances"].values()) if r.status_code == 200 else None


def lives(server: Server) -> tuple[int | None, frozenset[int]]:
    """Restarts by telemetry, and the worker processes (what tells a restart when telemetry is down)."""
    return restarts(server), frozenset(server.worker_pids())


def restarted(before: tuple[int | None, frozenset[int]], after: tuple[int | None, frozenset[int]]) -> bool:
    """The counter moved, or (telemetry down) new workers were spawned: either way the group is restarting."""
    counted = None not in (before[0], after[0]) and before[0] != after[0]
    return counted or bool(after[1] - before[1])


def healthy(server: Server) -> int:
    """Healthy and idle: a case is judged on a node with no call of an earlier case still in flight
    (one that was still decoding held the next case's call until it got a 429, at capacity). Returns
    the node's worker restarts then (/health counts them as telemetry does, for a fraction of its cost)."""
    def idle() -> tuple[int] | None:
        r = server.health()
        instances = r.json()["instances"].values() if r.status_code == 200 else ()
        if not instances or any(i.get("in_flight", 0) for i in instances):
            return None
        return (sum(i["restarts"] for i in instances),)
    return wait_for(idle, RECOVERY_S, "healthy and idle again")[0]


def error_problems(path: str, status: int, body: Any, names: list[str] | None) -> list[str]:
    """The error shape of the endpoint's API; a 400 names one of `names` (None: no check)."""
    anthropic = path.startswith(MESSAGES)
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str):
        return [f"{status} body is not an error object"]
    if anthropic and body.get("type") != "error":
        return [f'{status} body lacks "type": "error" (Anthropic shape)']
    if not anthropic and not {"param", "code"} <= err.keys():
        return [f"{status} error lacks param/code (OpenAI shape)"]
    said = f"{err.get('param') or ''} {err['message']}".lower()
    if status == 400 and names and not any(n.lower() in said for n in names):
        return [f"400 names none of {names}"]
    return []


def sse_problems(path: str, text: str) -> tuple[list[str], bool]:
    """A 2xx event stream parsed to its end; (problems, whether a token was generated)."""
    events = [block for block in text.split("\n\n") if block.strip()]
    datas = [line[6:] for block in events for line in block.split("\n") if line.startswith("data: ")]
    if path.startswith(MESSAGES):
        payloads = [json.loads(d) for d in datas]
        kinds = [p.get("type") for p in payloads]
        if "error" in kinds:
            return [f"in-band error event: {payloads[kinds.index('error')]}"], False
        if kinds[:1] != ["message_start"] or kinds[-1:] != ["message_stop"]:
            return [f"stream is not message_start ... message_stop: {kinds[:3]}...{kinds[-3:]}"], False
        return [], any(p.get("type") == "message_delta" and p["usage"]["output_tokens"] >= 1 for p in payloads)
    payloads = [json.loads(d) for d in datas if d != "[DONE]"]
    if any("error" in p for p in payloads):
        return [f"in-band error: {next(p for p in payloads if 'error' in p)}"], False
    if datas[-1:] != ["[DONE]"]:
        return [f"stream does not end with [DONE]: {datas[-2:]}"], False
    return [], any(c.get("finish_reason") for p in payloads for c in p.get("choices", []))


def body_problems(path: str, body: Any) -> tuple[list[str], bool]:
    """A 2xx JSON answer; (problems, whether a token was generated)."""
    try:
        if path.startswith(COUNT):
            return ([] if body["input_tokens"] > 0 else ["input_tokens is 0"]), False
        if path.startswith(MESSAGES):
            ok = body["type"] == "message" and isinstance(body["content"], list)
            return ([] if ok else ["not a message"]), body["usage"]["output_tokens"] >= 1
        usage = body["usage"]["completion_tokens"]
        ok = body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
        return ([] if ok else [f"finish_reason {body['choices'][0]['finish_reason']!r}"]), usage >= 1
    except (KeyError, IndexError, TypeError) as e:
        return [f"200 body misses {e!r}"], False


@dataclass
class Outcome:
    case: Case
    status: int
    problems: list[str]
    generated: bool
    excerpt: str = ""  # the answer's start, and for a 5xx what the server logged


def exchange(server: Server, client: httpx.Client, case: Case) -> Outcome:
    before, log_at = (healthy(server), frozenset(server.worker_pids())), server.log_path.stat().st_size
    content = iter([case.body[:7], case.body[7:]]) if case.chunked else case.body
    try:
        with client.stream("POST", server.base_url + case.path, headers=case.headers, content=content) as r:
            status, kind, raw = r.status_code, r.headers.get("content-type", ""), r.read()
    except httpx.HTTPError as e:
        return Outcome(case, 0, [f"no answer: {e!r}"], False, server.log()[log_at:][-1500:])
    log = server.log()[log_at:]  # what this request made the server say (before telemetry is polled again)
    text = raw.decode(errors="replace")
    problems, generated = [], False
    if status >= 500:
        problems.append(f"HTTP {status}")
    elif "text/event-stream" in kind and status == 200:
        try:
            problems, generated = sse_problems(case.path, text)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            problems = [f"unreadable event stream: {e!r}"]
    else:
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
            problems.append(f"{status} body is not JSON")
        if answer is not None and status == 200:
            problems, generated = body_problems(case.path, answer)
        elif answer is not None:
            names = None if any(m.field is None and m.tag != OK for m in case.mutations) else \
                [m.field for m in case.mutations if m.tag != OK]
            problems += error_problems(case.path, status, answer, names)
    if REFUSED in case.tags and status < 400:
        problems.append(f"HTTP {status} for a value docs/api.md refuses")
    if not case.tags & {REFUSED, EITHER} and status != 200 and 0 < status < 500:
        problems.append(f"HTTP {status} for a request docs/api.md accepts")
    after = lives(server)
    if status == 503 or any(p.startswith("in-band") for p in problems):  # a worker may be dying: see it restart
        deadline = time.monotonic() + 10
        while not restarted(before, after) and time.monotonic() < deadline:
            time.sleep(0.05)
            after = lives(server)
    if after[0] is None:  # (the first case to report it is the one that broke it)
        problems.append("GET /talaria/telemetry fails after this request")
    if restarted(before, after):
        workers = f"{sorted(before[1])} -> {sorted(after[1])}"
        problems.append(f"worker restarts {before[0]} -> {after[0]} (workers {workers})")
    logged = "\n--- server log ---\n" + log[-1500:] if problems and (status >= 500 or after != before) else ""
    return Outcome(case, status, problems, generated, text[:400] + logged)


def report(failures: list[Outcome], total: int, generated: int) -> str:
    """Failures grouped by what went wrong (status, first problem, the error message's gist)."""
    groups: dict[str, list[Outcome]] = {}
    for o in failures:
        gist = re.sub(r"(chatcmpl-|cmpl-|msg_)[0-9a-f]+|\d+", "#", o.excerpt.split("--- server log")[0][:160])
        groups.setdefault(f"{o.status} {o.problems[0]} | {gist}", []).append(o)
    lines = [f"{len(failures)} failing cases of {total} ({generated} reached generation) in {len(groups)} groups:"]
    for key, group in groups.items():
        lines += [f"\n== {key} ({len(group)} cases)"]
        for i, o in enumerate(group[:2]):
            excerpt = o.excerpt if i == 0 else o.excerpt.split("\n--- server log")[0]
            lines += [f"  mutations: {list(o.case.mutations)}", f"  problems: {o.problems}", f"  {o.case.curl()}",
                      "  answer: " + excerpt.replace("\n", "\n    ")]
    return "\n".join(lines)


# ---- the tests -----------------------------------------------------------------------------------

GREETING = [{"role": "user", "content": "Say hi."}]
SAY_SURROGATE = [{"role": "user", "content": f"Say {SURROGATE} hi."}]
REGRESSIONS = [  # (path, body, the field; OK: a 200, REFUSED: a 400 naming it), as docs/api.md says
    (CHAT, {"model": "smollm2", "messages": GREETING, "max_tokens": 2, "seed": 2**64}, "seed", REFUSED),
    (CHAT, {"model": "smollm2", "messages": GREETING, "max_tokens": 2, "seed": 2**64 - 1}, "seed", OK),
    (CHAT, {"model": "smollm2", "messages": GREETING, "max_tokens": 2, "temperature": 1e-300}, "temperature", OK),
    (CHAT, {"model": "smollm2", "messages": GREETING, "max_tokens": 2, "top_p": 1e-300}, "top_p", OK),
    (CHAT, {"model": "smollm2", "messages": SAY_SURROGATE, "max_tokens": 2}, "messages", REFUSED),
    (CHAT, {"model": "smollm2", "messages": GREETING, "max_tokens": 2, "top_logprobs": 2}, "top_logprobs", REFUSED),
    (COMPLETIONS, {"model": "tiny-llama", "prompt": "Once", "max_tokens": 2, "seed": -(2**70)}, "seed", REFUSED),
    (COMPLETIONS, {"model": "tiny-llama", "prompt": "Once", "max_tokens": 2, "seed": -(2**63) - 1}, "seed", REFUSED),
    (COMPLETIONS, {"model": "tiny-llama", "prompt": f"Once {SURROGATE}", "max_tokens": 2}, "prompt", REFUSED),
    (MESSAGES, {"model": "smollm2", "messages": GREETING, "max_tokens": 2, "temperature": 1e-300}, "temperature", OK),
    (MESSAGES, {"model": "smollm2", "messages": GREETING, "max_tokens": 2, "top_p": 1e-300}, "top_p", OK),
    (MESSAGES, {"model": "smollm2", "messages": SAY_SURROGATE, "max_tokens": 2}, "messages", REFUSED),
    (MESSAGES, {"model": "smollm2", "system": SURROGATE, "messages": GREETING, "max_tokens": 2}, "system", REFUSED),
    (COUNT, {"model": "smollm2", "messages": SAY_SURROGATE}, "messages", REFUSED),
]


def flush_sessions(server: Server) -> None:
    """Push every instance's recent sessions (the 256 its telemetry reports) out with fresh ones, so that a
    session id telemetry cannot encode does not fail the later tests that share this server."""
    for model in ("smollm2", "tiny-llama"):
        for i in range(257):
            httpx.post(server.api + "/completions", headers={"x-session-id": f"flush-{i}"}, timeout=60,
                       json={"model": model, "prompt": "a", "max_tokens": 1})


@pytest.mark.parametrize(("path", "body", "param", "tag"), REGRESSIONS, ids=[
    f"{p.removeprefix('/v1/').replace('/', '-')}-{name}" for (p, _, name, _) in REGRESSIONS])
def test_a_hostile_value_gets_what_the_docs_say(server, path, body, param, tag):
    case = Case(path, {"content-type": "application/json"}, dumps(body).encode(), (Mutation("set", param, None, tag),))
    with httpx.Client(timeout=60) as client:
        outcome = exchange(server, client, case)
    assert not outcome.problems, f"{outcome.status} {outcome.problems}\n{outcome.excerpt}"
    assert outcome.status == (400 if tag == REFUSED else 200), outcome.excerpt
    assert server.health().status_code == 200


def answer(server: Server, path: str, body: dict) -> str:
    """The text of a whole (not streamed) answer, which must be a 200."""
    r = httpx.post(server.base_url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    if path == MESSAGES:
        return "".join(block.get("text", "") for block in out["content"])
    return out["choices"][0]["message"]["content"] if path == CHAT else out["choices"][0]["text"]


@pytest.mark.parametrize(("path", "field"), [(CHAT, "temperature"), (CHAT, "top_p"), (MESSAGES, "temperature"),
                                             (MESSAGES, "top_p")])
def test_a_temperature_or_top_p_of_1e_300_samples_greedily(server, path, field):
    """docs/api.md: a temperature below 1e-5 is greedy, and top_p keeps the most likely token however
    small it is: 1e-300 gives temperature 0's text (at temperature 2 for top_p: nothing else is greedy)."""
    body = {"model": "smollm2", "messages": GREETING, "max_tokens": 8, "ignore_eos": True}
    greedy = answer(server, path, {**body, "temperature": 0})
    tiny = {"temperature": 1e-300} if field == "temperature" else {"temperature": 1 if path == MESSAGES else 2,
                                                                   "top_p": 1e-300}
    assert answer(server, path, {**body, **tiny}) == greedy


SAMPLED = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 2.0, "ignore_eos": True}


def test_an_accepted_seed_decides_the_stream(server):
    """docs/api.md: a seed is an integer in [-2^63, 2^64 - 1], and the same seed and prompt give the
    same tokens. Each end of the range is served and reproducible (not dropped for a random seed);
    2^64 - 1 is neither 2^63 - 1 (clamped to int64) nor 0; -1 and -2^63 are not 0 (clamped at 0).
    Temperature 2 on SmolLM2's 49,152 tokens: two seeds' 12 tokens agree by chance next to never."""
    seeds = (0, 2**63 - 1, 2**64 - 1, -1, -(2**63))
    texts = {seed: answer(server, COMPLETIONS, {**SAMPLED, "seed": seed}) for seed in seeds}
    for seed in seeds:
        assert answer(server, COMPLETIONS, {**SAMPLED, "seed": seed}) == texts[seed], f"seed {seed}: two streams"
    assert len({texts[0], texts[2**63 - 1], texts[2**64 - 1]}) == 3, texts
    assert texts[-1] != texts[0] and texts[-(2**63)] != texts[0], texts


def test_a_session_id_with_a_lone_surrogate_is_refused_and_telemetry_stays_readable(server):
    body = {"model": "tiny-llama", "messages": GREETING, "max_tokens": 1, "session_id": f"s-{SURROGATE}"}
    case = Case(CHAT, {"content-type": "application/json"}, dumps(body).encode(),
                (Mutation("set", "session_id", None, REFUSED),))
    try:
        with httpx.Client(timeout=60) as client:
            outcome = exchange(server, client, case)
        assert not outcome.problems, f"{outcome.status} {outcome.problems}\n{outcome.excerpt}"
    finally:
        if restarts(server) is None:
            flush_sessions(server)


def test_fuzzed_requests_get_no_5xx_and_cost_no_worker_restart(server):
    healthy(server)
    start = restarts(server)
    outcomes: list[Outcome] = []
    client = httpx.Client(timeout=120)

    @settings(max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate])  # no shrinking: failures are collected, not raised
    @given(case=cases())
    def fuzz(case: Case) -> None:
        outcomes.append(exchange(server, client, case))

    with client:
        fuzz()
    failures = [o for o in outcomes if o.problems]
    generated = sum(o.generated for o in outcomes)
    end = restarts(server)
    if end is None:
        flush_sessions(server)
    assert not failures, report(failures, len(outcomes), generated)
    assert len(outcomes) >= 300 and generated >= 100, (len(outcomes), generated)
    assert end == start
    assert server.health().status_code == 200
