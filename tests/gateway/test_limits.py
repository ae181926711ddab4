"""The [server] limits piece by piece: `ConnectionLimit` on a bare ASGI app, `read_json`'s deadline on
a scripted receive channel, and `send_deadline_protocol` under a real uvicorn with a client that
stops reading (tests/test_limits.py checks all three against `talaria up`)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from starlette.requests import Request

from talaria.gateway.errors import APIError
from talaria.gateway.http import read_json
from talaria.gateway.limits import ConnectionLimit, send_deadline_protocol
from talaria.gateway.sse import CancelOnDisconnect

# ---- ConnectionLimit --------------------------------------------------------------------------


class HeldApp:
    """An ASGI app whose requests stay in progress until `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = 0

    async def __call__(self, scope, receive, send) -> None:
        self.entered += 1
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def request(app, path: str) -> tuple[int, dict, bytes]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app({"type": "http", "method": "POST", "path": path, "headers": []}, receive, send)
    headers = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


def test_requests_over_the_limit_get_503_in_their_api_shape_and_probes_pass():
    async def main() -> None:
        inner = HeldApp()
        limited = ConnectionLimit(inner, limit=2)
        held = [asyncio.create_task(request(limited, "/v1/completions")) for _ in range(2)]
        probe = asyncio.create_task(request(limited, "/health"))
        while inner.entered < 3:
            await asyncio.sleep(0)
        assert limited.busy == 2  # the probe is not counted

        status, headers, body = await request(limited, "/v1/chat/completions")
        assert status == 503 and headers["retry-after"] and headers["connection"] == "close"
        error = json.loads(body)["error"]
        assert (error["type"], error["code"]) == ("service_unavailable_error", "too_many_connections")
        status, _, body = await request(limited, "/v1/messages")
        assert status == 503 and json.loads(body) == {
            "type": "error", "error": {"type": "overloaded_error", "message": error["message"]}}
        assert inner.entered == 3  # the refused requests never reached the app

        inner.release.set()
        assert [(await t)[0] for t in [*held, probe]] == [200, 200, 200]
        assert limited.busy == 0
        assert (await request(limited, "/v1/completions"))[0] == 200

    asyncio.run(main())


def test_a_request_that_fails_frees_its_place():
    async def failing(scope, receive, send) -> None:
        raise RuntimeError("boom")

    async def main() -> None:
        limited = ConnectionLimit(failing, limit=1)
        for _ in range(2):
            with pytest.raises(RuntimeError):
                await request(limited, "/v1/completions")
        assert limited.busy == 0

    asyncio.run(main())


# ---- read_json's deadline ---------------------------------------------------------------------


def trickled(body: bytes, every_s: float) -> Request:
    """A request whose body arrives one byte every `every_s` seconds."""
    chunks = iter(body)

    async def receive() -> dict:
        await asyncio.sleep(every_s)
        byte = next(chunks, None)
        return {"type": "http.request", "body": b"" if byte is None else bytes([byte]), "more_body": byte is not None}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-length", str(len(body)).encode())]}
    return Request(scope, receive)


def test_a_body_slower_than_the_deadline_is_a_408_however_often_its_bytes_come():
    """A byte every 10 ms: a deadline per chunk would never fire; the one over the body does."""
    async def main() -> tuple[APIError, float]:
        start = time.monotonic()
        with pytest.raises(APIError) as info:
            await read_json(trickled(b'{"prompt": "' + b"x" * 1000 + b'"}', 0.01), 1 << 20, timeout_s=0.2)
        return info.value, time.monotonic() - start

    error, took = asyncio.run(main())
    assert error.status == 408 and error.code == "request_timeout" and "read_timeout_s" in error.message
    assert error.headers == {"Connection": "close"}  # the rest of the body is not read
    assert 0.2 <= took < 1.0


def test_a_body_within_the_deadline_or_without_one_is_read():
    body = b'{"prompt": "hi"}'
    assert asyncio.run(read_json(trickled(body, 0.001), 1 << 20, timeout_s=5.0)) == {"prompt": "hi"}
    assert asyncio.run(read_json(trickled(body, 0.001), 1 << 20, timeout_s=0)) == {"prompt": "hi"}  # 0: none


# ---- send_deadline_protocol -------------------------------------------------------------------

SEND_TIMEOUT_S = 0.2


@contextmanager
def served(app) -> Iterator[tuple[str, int]]:
    """`app` under uvicorn with the send deadline, in a thread; its address."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           http=send_deadline_protocol(SEND_TIMEOUT_S)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def stalled_client(address: tuple[str, int]) -> socket.socket:
    """A connection that asks for / and will not read (the smallest buffers the kernel allows)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(address)
    sock.sendall(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
    return sock


def drain(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    got = b""
    try:
        while chunk := sock.recv(1 << 16):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def test_a_stream_whose_client_stops_reading_is_cancelled_and_its_connection_closed():
    ended = threading.Event()
    seen: dict = {}

    async def endless(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        async with CancelOnDisconnect(receive) as watch:
            try:
                while True:
                    await send({"type": "http.response.body", "body": b"x" * 4096, "more_body": True})
            finally:
                seen["disconnected"] = watch.disconnected
                ended.set()

    with served(endless) as address, stalled_client(address) as sock:
        assert ended.wait(10), "the stream was never stopped"
        assert seen == {"disconnected": True}
        assert drain(sock).startswith(b"HTTP/1.1 200 ")  # what the buffers held, then the connection's end


def test_a_slow_reader_is_never_dropped():
    """A 16 MB response read 1 MB at a time with pauses shorter than the deadline: the transport is
    paused for several deadlines in all, but the client never stops reading for one."""
    body = b"y" * (16 << 20)  # loopback's buffers hold ~4 MB: the rest waits in the transport

    async def whole(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    with served(whole) as address, socket.create_connection(address) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
        sock.settimeout(10)
        got = bytearray()
        while len(got) < len(body) and (chunk := sock.recv(1 << 20)):
            got += chunk
            time.sleep(SEND_TIMEOUT_S / 4)  # the reader's own pace
    assert got.endswith(body)
