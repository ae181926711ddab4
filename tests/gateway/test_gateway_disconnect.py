"""A client that goes away stops its call: the instance stream is closed, streamed or not.

Driven through the raw ASGI interface so the test decides exactly when `http.disconnect` arrives;
the fake group signals (an event, no sleeps) when it is blocked waiting for the next token.
"""

import json

import anyio
import pytest

from talaria.gateway.gateway import create_app

from .fakes import MODEL, FakeEchoGroup, FakeEchoSupervisor

pytestmark = pytest.mark.anyio


async def post_then_disconnect(app, path: str, body: dict, disconnect: anyio.Event, spec: str) -> list[dict]:
    raw = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
    }
    body_sent = False
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_closes_the_instance_stream(stream, spec):
    group = FakeEchoGroup("hot0", hang_after=2, hanging=anyio.Event())
    app = create_app(FakeEchoSupervisor([group]))
    disconnect = anyio.Event()
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 50, "stream": stream}
    result: list[list[dict]] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            async def run() -> None:
                result.append(await post_then_disconnect(app, "/v1/completions", body, disconnect, spec))
            tg.start_soon(run)
            await group.hanging.wait()  # two tokens out, the third never comes
            assert group.closed == [] and group.in_flight == 1
            disconnect.set()
    assert group.closed == [group.calls[0].request_id] and group.completed == []
    assert group.in_flight == 0
    assert all(v.in_flight == 0 for v in app.state.gateway.dispatcher.router.views.values())  # the call was recorded
    sent = result[0]
    if stream:  # the tokens produced before the disconnect were sent, and no [DONE]
        data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        assert b'"text":"a"' in data and b'"text":"b"' in data and b"[DONE]" not in data
    else:
        assert sent[0]["status"] == 499


async def test_finished_stream_closes_generator_without_disconnect():
    group = FakeEchoGroup("hot0")
    app = create_app(FakeEchoSupervisor([group]))
    disconnect = anyio.Event()  # never set: the response must complete on its own
    with anyio.fail_after(5):
        sent = await post_then_disconnect(app, "/v1/completions",
                                          {"model": MODEL, "prompt": "a", "max_tokens": 3, "stream": True},
                                          disconnect, "2.3")
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert group.completed == group.closed == [group.calls[0].request_id]
