"""`CancelOnDisconnect` ends only the cancellation it caused: a client leaving stops the body and the
request goes on; a server's own cancellation (shutdown) always propagates, alone or beside one."""

import asyncio

from talaria.gateway.sse import CancelOnDisconnect


class Client:
    """An ASGI receive channel whose disconnect the test triggers."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def watched(client: Client, body_started: asyncio.Event, log: list) -> None:
    async with CancelOnDisconnect(client.receive) as watch:
        try:
            body_started.set()
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.01)  # a finally may await after the cancellation
            log.append("finally")
    log.append(("after", watch.disconnected, asyncio.current_task().cancelling()))


def run(scenario) -> list:
    async def main() -> list:
        client, started, log = Client(), asyncio.Event(), []
        task = asyncio.create_task(watched(client, started, log))
        await started.wait()
        await scenario(client, task)
        try:
            await asyncio.wait_for(task, 5)
        except asyncio.CancelledError:
            log.append("cancelled")
        return log
    return asyncio.run(main())


def test_a_client_that_leaves_stops_the_body_and_the_request_goes_on():
    async def leave(client, task):
        client.gone.set()
    assert run(leave) == ["finally", ("after", True, 0)]


def test_a_server_cancellation_propagates():
    async def shutdown(client, task):
        task.cancel()
    assert run(shutdown) == ["finally", "cancelled"]


def test_a_server_cancellation_beside_a_disconnect_still_propagates():
    async def both(client, task):
        client.gone.set()
        await asyncio.sleep(0)  # the watcher runs and cancels
        task.cancel()  # and the server cancels too, before the body has seen either
    assert run(both) == ["finally", "cancelled"]


def test_a_disconnect_during_a_server_cancellation_is_not_a_second_cancel():
    async def shutdown_then_leave(client, task):
        task.cancel()
        await asyncio.sleep(0)  # the body is in its finally, awaiting
        client.gone.set()
    assert run(shutdown_then_leave) == ["finally", "cancelled"]
