"""Operator endpoints beside the OpenAI API: instance telemetry and forced model switches.

`GET /talaria/telemetry` returns each instance's latest snapshot (InstanceStats as JSON: queues,
KV pages, active model, switches, the substrate's staging and host-KV state). `GET
/talaria/events[?since=SEQ]` streams the event log as server-sent events, replaying buffered events
after SEQ first. `POST
/talaria/admin/switch` with `{"instance": NAME, "model": NAME}` opens that model on that instance
now and answers with the switch record (per-rank phase times, path, staged and dirty bytes).
All need the API key when one is configured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from talaria.contracts.profile_file import dump_profile
from talaria.contracts.telemetry import InstanceTelemetry, NodeTelemetry
from talaria.gateway.errors import (
    INVALID_REQUEST,
    NOT_FOUND,
    RETRY_AFTER_S,
    UNAVAILABLE,
    APIError,
)
from talaria.gateway.sse import SSEResponse
from talaria.node.errors import InstanceFailed, InstanceUnavailable

if TYPE_CHECKING:
    from talaria.gateway.gateway import Gateway


SWITCH_TIMEOUT_S = 120.0


def admin_routes(gateway: Gateway, read_json) -> list[Route]:
    supervisor = gateway.supervisor

    async def telemetry(request: Request) -> JSONResponse:
        gateway.keys.telemetry(request)
        instances = {}
        for g in supervisor.groups:
            profile = g.ready.profile if g.ready is not None else None
            instances[g.name] = InstanceTelemetry(g.healthy, g.in_flight, g.config.models, g.stats,
                                                  dump_profile(profile) if profile is not None else None, g.restarts,
                                                  g.state, g.last_failure)
        router = gateway.dispatcher.router
        return JSONResponse(NodeTelemetry(router.clock(), instances, router.telemetry()).to_dict())

    async def switch(request: Request) -> JSONResponse:
        gateway.keys.admin_only(request)
        body = await read_json(request, gateway.config.server.max_body_bytes)
        if not isinstance(body, dict) or not isinstance(body.get("instance"), str) \
                or not isinstance(body.get("model"), str):
            raise APIError.invalid('body must be {"instance": NAME, "model": NAME}', "instance")
        group = next((g for g in supervisor.groups if g.name == body["instance"]), None)
        if group is None:
            raise APIError(404, f"no instance named {body['instance']!r}", NOT_FOUND, "instance",
                           "instance_not_found")
        if body["model"] not in group.config.models:
            raise APIError(400, f"instance {group.name!r} does not serve {body['model']!r}; it serves "
                           f"{', '.join(group.config.models)}", INVALID_REQUEST, "model", "model_not_served")
        try:
            record = await group.switch(body["model"], SWITCH_TIMEOUT_S)
        except (InstanceFailed, InstanceUnavailable, TimeoutError) as e:
            raise APIError(503, str(e) or "the switch did not finish in time", UNAVAILABLE, None,
                           "switch_failed", {"Retry-After": str(RETRY_AFTER_S)}) from None
        return JSONResponse({"instance": group.name, "model": body["model"], "switch": record})

    async def events(request: Request) -> SSEResponse:
        gateway.keys.admin_only(request)
        try:
            since = int(request.query_params.get("since", "0"))
        except ValueError:
            raise APIError.invalid("since must be an integer event sequence number", "since") from None

        async def stream():
            async for event in supervisor.events.follow(since):
                yield f"data: {event.to_json()}\n\n".encode()
        return SSEResponse(stream())

    return [Route("/talaria/telemetry", telemetry, methods=["GET"]),
            Route("/talaria/events", events, methods=["GET"]),
            Route("/talaria/admin/switch", switch, methods=["POST"])]
