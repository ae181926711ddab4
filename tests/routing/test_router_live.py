"""The session-aware router on live nodes: real `talaria up` processes, real engine workers.

1. One node, two hot instances serving one tiny model: concurrent agent-like sessions each stay on
   one instance, every return consumes its session's lease (`lease-hit`), and every placement is
   explained in the event log (reason, and the cost terms for a ranked one).
2. Two nodes on loopback: node A lists node B as a peer; a session for a model only B serves is
   routed by A to B's instance (ranked, then lease hits), forwarded with streaming preserved, and
   served by B on its own instance, with the same greedy output as calling B directly. A model A
   serves stays on A.

Where a call went is read from the node's event log (JSONL): `route` and `lease` records from
instance "router", matched to calls by request id or session id.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import Server, start_server, wait_for

pytestmark = pytest.mark.slow

SESSIONS, CALLS = 4, 3
MAX_TOKENS = 8
GAP_S = (0.1, 0.3)
LEASE_S = 2.0
VIEW_TIMEOUT_S = 10.0
COST_TERMS = {"total_s", "delta_r_s", "c_kv_s", "c_act_s"}
REASONS = {"lease-hit", "ranked", "replica", "sticky", "least-pressure", "overload"}

# The synthetic models of talaria/talaria.toml, entry for entry.
MODELS = {
    "tiny-llama": ('[[models]]\nname = "tiny-llama"\nsource = "synthetic:"\ndtype = "float32"\nseed = 1\n\n'
                   '[models.shape]\nfamily = "llama"\nhidden_size = 128\nintermediate_size = 256\n'
                   'num_layers = 4\nnum_heads = 4\nnum_kv_heads = 2\nvocab_size = 512\nmax_position = 2048\n'
                   'tie_word_embeddings = false\n\n'),
    "tiny-qwen3": ('[[models]]\nname = "tiny-qwen3"\nsource = "synthetic:"\ndtype = "float32"\nseed = 2\n\n'
                   '[models.shape]\nfamily = "qwen3"\nhidden_size = 128\nintermediate_size = 256\n'
                   'num_layers = 4\nnum_heads = 4\nnum_kv_heads = 2\nvocab_size = 512\nmax_position = 2048\n'
                   'tie_word_embeddings = true\n\n'),
}


def hot(name: str, model: str) -> str:
    return (f'[[instances]]\nname = "{name}"\npool = "hot"\nmodels = ["{model}"]\ntp = 1\n'
            'arena_bytes = "128MiB"\nhost_kv_bytes = "16MiB"\n\n')


def write_config(directory: Path, models: list[str], instances: list[tuple[str, str]],
                 peers: tuple[str, ...] = ()) -> Path:
    """A node config with an event log at `directory / "events.jsonl"`."""
    router = f'[router]\npolicy = "full"\nlease_s = {LEASE_S}\n\n'
    router += "".join(f'[[router.peers]]\nurl = "{url}"\n\n' for url in peers)
    path = directory / "talaria.toml"
    path.write_text('[server]\nhost = "127.0.0.1"\n\n' + "".join(MODELS[m] for m in models)
                    + "".join(hot(n, m) for n, m in instances) + router
                    + f'[telemetry]\nevents_path = "{directory / "events.jsonl"}"\n')
    return path


def events(directory: Path, kind: str) -> list[dict]:
    lines = (directory / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, filter(str.strip, lines)) if e["kind"] == kind]


def placed_on(route: dict) -> str:
    """The instance a `route` event chose (data key `target`; the envelope's `instance` is "router")."""
    return route["target"]


def assert_explained(route: dict) -> None:
    """A route event says why: a known reason, and the cost terms behind a ranked choice."""
    assert route["reason"] in REASONS, route
    if route["reason"] == "ranked":
        assert COST_TERMS <= set(route["cost"] or {}), route
        assert route["cost"]["total_s"] >= 0, route


def completion(client: httpx.Client, base_url: str, model: str, prompt: str, session: str,
               stream: bool = False) -> tuple[str, httpx.Response]:
    """One greedy text completion; (its text, the response). A stream is checked as SSE on the way."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    headers = {"x-session-id": session}
    if not stream:
        r = client.post(base_url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "text_completion" and out["model"] == model, out
        assert len(out["choices"]) == 1 and out["choices"][0]["finish_reason"] == "length", out
        assert out["usage"]["completion_tokens"] == MAX_TOKENS, out
        return out["choices"][0]["text"], r
    with client.stream("POST", base_url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]", lines[-3:]
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert chunks and all(c["object"] == "text_completion" and c["model"] == model for c in chunks), chunks
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    return "".join(c["choices"][0]["text"] for c in chunks), r


def telemetry(server: Server) -> dict:
    return server.telemetry(timeout=5).json()


# ---- one node, two hot instances ------------------------------------------------------------


def agent_session(base_url: str, sid: str, seed: int) -> list[str]:
    """CALLS calls, each prompt the previous prompt plus its output plus a new turn; request ids."""
    rng = random.Random(seed)
    prompt, ids = f"You are agent {sid}. Task: list the files, then read the largest one.\n", []
    with httpx.Client(timeout=60) as client:
        for turn in range(CALLS):
            if turn:
                time.sleep(rng.uniform(*GAP_S))  # the agent's tool call between two model calls
            text, r = completion(client, base_url, "tiny-llama", prompt, sid)
            ids.append(r.headers["x-request-id"])
            prompt += text + f"\nTool result {turn}: ok, {rng.randrange(1000)} bytes.\n"
    return ids


def test_sessions_stay_on_their_instance_through_leases(tmp_path):
    config = write_config(tmp_path, ["tiny-llama"], [("hot-0", "tiny-llama"), ("hot-1", "tiny-llama")])
    server = start_server(config, tmp_path / "talaria.log")
    try:
        server.wait_healthy()
        sids = [f"agent-{i}" for i in range(SESSIONS)]
        with ThreadPoolExecutor(SESSIONS) as pool:
            calls = dict(zip(sids, pool.map(agent_session, [server.base_url] * SESSIONS, sids, range(SESSIONS))))
        router = telemetry(server)["router"]
    finally:
        server.stop()

    routes = events(tmp_path, "route")
    by_request: dict[str, list[dict]] = {}
    for r in routes:
        by_request.setdefault(r["request"], []).append(r)
    installs = [e for e in events(tmp_path, "lease") if e["op"] == "install"]
    for sid, ids in calls.items():
        assert all(len(by_request.get(i, ())) == 1 for i in ids), f"{sid}: route events per call " \
            f"{[len(by_request.get(i, ())) for i in ids]}"
        mine = [by_request[i][0] for i in ids]
        for r in mine:
            assert r["session"] == sid and r["model"] == "tiny-llama", r
            assert_explained(r)
        assert placed_on(mine[0]) in ("hot-0", "hot-1"), mine[0]
        assert {placed_on(r) for r in mine} == {placed_on(mine[0])}, f"{sid} moved: {mine}"
        assert [(r["reason"], r["same_instance"]) for r in mine[1:]] == [("lease-hit", True)] * (CALLS - 1), mine
        assert sum(e["session"] == sid for e in installs) == CALLS, f"{sid}: lease installs {installs}"
    returns = SESSIONS * (CALLS - 1)
    assert router["lease_hits"] == returns and router["returns"] == returns, router


# ---- two nodes: a peer's model is routed, forwarded and served there -----------------------------


def test_peer_model_is_forwarded_and_served_on_the_peer(tmp_path):
    dir_a, dir_b = tmp_path / "a", tmp_path / "b"
    dir_a.mkdir()
    dir_b.mkdir()
    b = start_server(write_config(dir_b, ["tiny-qwen3"], [("hot-b", "tiny-qwen3")]), dir_b / "talaria.log")
    a = None
    try:
        b.wait_healthy()
        a = start_server(write_config(dir_a, ["tiny-llama", "tiny-qwen3"], [("hot-a", "tiny-llama")],
                                      (b.base_url,)), dir_a / "talaria.log")
        a.wait_healthy()
        remote = f"{b.base_url.removeprefix('http://')}/hot-b"

        def b_listed() -> bool:
            view = telemetry(a)["router"]["views"].get(remote)
            return bool(view and view["healthy"] and view["node"] == b.base_url
                        and view["snapshot_age_s"] is not None)
        wait_for(b_listed, VIEW_TIMEOUT_S, f"{remote} listed healthy in A's router views")

        sid, prompt = "peer-session", "You are a careful agent. Step 1: read the README.\n"
        prompts, via_a, b_request_ids = [], [], []
        with httpx.Client(timeout=60) as client:
            for turn in range(CALLS):
                if turn:
                    time.sleep(0.2)
                prompts.append(prompt)
                text, r = completion(client, a.base_url, "tiny-qwen3", prompt, sid, stream=turn == 1)
                via_a.append(text)
                b_request_ids.append(r.headers["x-request-id"])  # the peer's id, passed through
                prompt += text + f"\nStep {turn + 2}: go on.\n"
            direct = [completion(client, b.base_url, "tiny-qwen3", p, f"direct-{i}", stream=i == 1)[0]
                      for i, p in enumerate(prompts)]
            _, local = completion(client, a.base_url, "tiny-llama", "Hello from A.\n", "local-session")
    finally:
        if a is not None:
            a.stop()
        b.stop()

    assert via_a == direct, "forwarded output differs from calling the peer directly (greedy)"
    assert local.headers["x-talaria-instance"] == "hot-a", local.headers

    a_routes = events(dir_a, "route")
    mine = [r for r in a_routes if r["session"] == sid]
    assert len(mine) == CALLS, mine
    for r in mine:
        assert_explained(r)
    assert [placed_on(r) for r in mine] == [remote] * CALLS, mine
    assert [r["reason"] for r in mine] == ["ranked"] + ["lease-hit"] * (CALLS - 1), mine
    llama = [r for r in a_routes if r["session"] == "local-session"]
    assert len(llama) == 1 and placed_on(llama[0]) == "hot-a", llama

    b_routes = [r for r in events(dir_b, "route") if r["session"] == sid]
    assert [r["request"] for r in b_routes] == b_request_ids, b_routes
    assert [placed_on(r) for r in b_routes] == ["hot-b"] * CALLS, b_routes
