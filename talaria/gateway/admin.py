"""Operator endpoints beside the OpenAI API: instance telemetry and forced model switches.

`GET /talaria/telemetry` returns each instance's latest snapshot (InstanceStats as JSON: queues,
KV pages, active model, switches, the substrate's staging and host-KV state). `GET
/talaria/events[?since=SEQ]` streams the event log as server-sent events, replaying buffered events
after SEQ first. `POST
/talaria/admin/switch` with `{"instance": NAME, "model": NAME}` opens that model on that instance
now and answers with the switch record (per-rank phase times, path, staged and dirty bytes).
`POST /talaria/admin/drain` starts the drain a Kubernetes preStop asks for (`talaria drain`): the
node goes on serving every call that reaches it, but `/health` answers 503 "draining" (readiness
takes it out of its Service) and its telemetry shows every instance unhealthy, state "draining"
(peers place nothing new there); it answers with the calls still in flight here, which the caller
polls down to zero. The telemetry answer carries the node's id (`NODE_HEADER`), by which a node
that reaches itself through its peers' name knows it. All need the API key when one is configured.
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
from talaria.routing.peers import NODE_HEADER

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
            draining = gateway.draining and g.healthy
            instances[g.name] = InstanceTelemetry(g.healthy and not draining, g.in_flight, g.config.models, g.stats,
                                                  dump_profile(profile) if profile is not None else None, g.restarts,
                                                  "draining" if draining else g.state, g.last_failure)
        router = gateway.dispatcher.router
        body = NodeTelemetry(router.clock(), instances,
                             {**gateway.dispatcher.telemetry(), "peers": gateway.peers.telemetry()})
        return JSONResponse(body.to_dict(), headers={NODE_HEADER: gateway.node_id})

    async def drain(request: Request) -> JSONResponse:
        gateway.keys.admin_only(request)
        gateway.draining = True
        dispatcher = gateway.dispatcher
        forwarded = sum(v.in_flight for v in dispatcher.router.views.values() if v.node is not None)
        in_flight = sum(g.in_flight for g in supervisor.groups) + forwarded + len(dispatcher.held)
        return JSONResponse({"draining": True, "in_flight": in_flight, "drain_s": gateway.config.server.drain_s})

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
            Route("/talaria/admin/switch", switch, methods=["POST"]),
            Route("/talaria/admin/drain", drain, methods=["POST"])]
