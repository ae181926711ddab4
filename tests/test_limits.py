"""The [server] limits against a real `talaria up`: requests over `max_connections` get a JSON 503
while `/health` still answers, a body trickled past `read_timeout_s` gets a 408 and its connection
closed, and a client that stops reading its stream is dropped after `send_timeout_s` with its call
cancelled on the instance.

One small server serves the module: a tiny synthetic model on one rank, and small limits.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import Server, served, tiny_llama_toml, wait_for

pytestmark = pytest.mark.slow

MAX_CONNECTIONS = 2
READ_TIMEOUT_S = 1.0
SEND_TIMEOUT_S = 2.0
TRICKLE_S = 0.2  # between two bytes of a slow body: a deadline per chunk would never fire
STALL_TOKENS = 30_000  # decoding them all takes the engine 20 s or more; the buffers fill after ~200
DROPPED_WITHIN_S = 30.0  # the buffers fill (~80 KB of events), then SEND_TIMEOUT_S passes
# Every streamed event names its model: with a 2,000-character name each is ~2 KB, so a stalled
# client's buffers fill within a hundred or so tokens, even on a busy CPU
MODEL = "tiny-" + "m" * 2000

# vocab 259: bytes + bos/eos/pad only, no reserved ids that decode to nothing
CONFIG = f"""
[server]
host = "127.0.0.1"
max_connections = {MAX_CONNECTIONS}
read_timeout_s = {READ_TIMEOUT_S}
send_timeout_s = {SEND_TIMEOUT_S}

{tiny_llama_toml(MODEL, 3, vocab_size=259, max_position=32768, tie_word_embeddings=False)}
[[instances]]
name = "hot-0"
pool = "hot"
models = ["{MODEL}"]
tp = 1
arena_bytes = "64MiB"
"""

LONG = {"model": MODEL, "prompt": "a", "max_tokens": STALL_TOKENS, "stream": True, "ignore_eos": True,
        "temperature": 0}  # greedy decoding is the engine's fast path


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[Server]:
    with served(tmp_path_factory.mktemp("limits"), CONFIG) as srv:
        yield srv


def in_flight(server: Server) -> int:
    return server.health().json()["instances"]["hot-0"]["in_flight"]


def instance_stats(server: Server) -> dict:
    return server.telemetry(timeout=5).json()["instances"]["hot-0"]["stats"]


def assert_serving(server: Server) -> None:
    """Nothing is left in flight and a new call completes."""
    wait_for(lambda: in_flight(server) == 0, 10, "no call in flight")
    done = httpx.post(server.api + "/completions", json={"model": MODEL, "prompt": "b", "max_tokens": 3,
                                                         "ignore_eos": True}, timeout=30)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3


def http_request(path: str, body: bytes, length: int | None = None) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: talaria\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body) if length is None else length}\r\n\r\n").encode() + body


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """Everything the server sent, and whether it then closed the connection (EOF or reset)."""
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        return got, False
    return got, True


def test_requests_over_the_limit_get_a_json_503_and_health_still_answers(node):
    with contextlib.ExitStack() as held:
        for _ in range(MAX_CONNECTIONS):  # each a connection with a call in progress
            assert held.enter_context(httpx.stream("POST", node.api + "/completions", json=LONG,
                                                   timeout=30)).status_code == 200
        openai_style = httpx.post(node.api + "/completions", json={"model": MODEL, "prompt": "a"}, timeout=10)
        anthropic_style = httpx.post(node.api + "/messages", timeout=10, json={
            "model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
        health = node.health()
        metrics = httpx.get(node.base_url + "/metrics", timeout=5)
    assert openai_style.status_code == 503 and openai_style.headers["retry-after"]
    assert openai_style.headers["connection"] == "close"
    error = openai_style.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable_error", "too_many_connections")
    assert "max_connections" in error["message"]
    assert anthropic_style.status_code == 503
    assert anthropic_style.json()["type"] == "error"
    assert anthropic_style.json()["error"]["type"] == "overloaded_error"
    assert health.status_code == 200 and metrics.status_code == 200  # probes are never refused
    assert 'talaria_requests_total{endpoint="/v1/messages",status="503"} 1.0' in metrics.text  # and counted
    assert_serving(node)  # the held streams were cancelled when their clients left


@pytest.mark.parametrize("path, shape", [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")])
def test_a_body_trickled_past_the_deadline_gets_a_408_and_is_cut(node, path, shape):
    body = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).encode()
    with socket.create_connection(("127.0.0.1", int(node.base_url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(http_request(path, b"", len(body)))
        started = time.monotonic()
        for byte in body:  # one byte every TRICKLE_S until the server answers
            sock.sendall(bytes([byte]))
            if select.select([sock], [], [], TRICKLE_S)[0]:
                break
        answered_after = time.monotonic() - started
        response, closed = read_until_closed(sock, 5)
    head, _, payload = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), response[:200]
    assert closed, "the server closes the connection instead of reading the rest of the body"
    # the server's deadline runs from the request's start, a moment before `started` here (0.99997 s seen once)
    assert READ_TIMEOUT_S - 0.05 <= answered_after < READ_TIMEOUT_S + 1.0, answered_after
    error = json.loads(payload)
    if shape == "openai":
        assert error["error"]["code"] == "request_timeout" and "read_timeout_s" in error["error"]["message"]
    else:
        assert error["type"] == "error" and "read_timeout_s" in error["error"]["message"]
    assert node.health().status_code == 200
    assert_serving(node)


def test_a_client_that_stops_reading_is_dropped_and_its_call_cancelled(node):
    """A raw client with the smallest receive buffer asks for a long stream and never reads: once
    the buffers are full the server waits SEND_TIMEOUT_S, then closes the connection and cancels
    the call on the instance long before its STALL_TOKENS are decoded."""
    port = int(node.base_url.rsplit(":", 1)[1])
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the kernel's minimum
        # and small segments: with loopback's 64 KiB ones the kernel queues far beyond SO_RCVBUF
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        sock.connect(("127.0.0.1", port))
        sock.sendall(http_request("/v1/completions", json.dumps(LONG).encode()))
        sessions_before = {s["session"] for s in instance_stats(node)["sessions"]}
        wait_for(lambda: in_flight(node) == 1, 10, "the call started")
        started = time.monotonic()
        wait_for(lambda: in_flight(node) == 0, DROPPED_WITHIN_S, "the stalled call cancelled")
        dropped_after = time.monotonic() - started
        wait_for(lambda: "(server.send_timeout_s): connection dropped" in node.log(), 5, "the drop logged")
        stats = wait_for(lambda: (s := instance_stats(node))["running"] == 0 and s, 5, "nothing running")
        received, closed = read_until_closed(sock, 5)
    assert dropped_after >= SEND_TIMEOUT_S
    # the instance keeps a cancelled call's KV: the call stopped decoding far short of STALL_TOKENS
    kept = [s["kv_tokens"] for s in stats["sessions"] if s["session"] not in sessions_before]
    assert kept and max(kept) < STALL_TOKENS, kept
    assert closed and received.startswith(b"HTTP/1.1 200 ")
    assert b"data: [DONE]" not in received  # cut, not finished
    assert_serving(node)
