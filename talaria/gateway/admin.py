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

from dataclasses import asdict
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from talaria.contracts.profile import dump_profile
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
    from talaria.routing.router import Router


def router_telemetry(router: Router) -> dict:
    """The router's counters and live leases (with seconds left), for the dashboard and operators."""
    now, st = router.clock(), router.stats
    router.leases.sweep(now)
    return {
        "policy": router.config.policy.value,
        "decisions": st.by_reason(),
        "lease_hits": st.lease_hits, "lease_misses": st.lease_misses, "lease_expiries": st.lease_expiries,
        "returns": st.returns, "same_instance_returns": st.same_instance_returns,
        "avoidable_opens": st.avoidable_opens, "sessions": len(router.sessions),
        "leases": [{"session": lease.session, "model": lease.model, "instance": lease.instance,
                    "expires_in_s": lease.t_exp - now} for lease in router.leases.all()[:256]],
        "views": {v.name: {"node": v.node, "healthy": v.healthy, "in_flight": v.in_flight,
                           "snapshot_age_s": now - v.received_at if v.snapshot is not None else None}
                  for v in router.views.values()},
    }

SWITCH_TIMEOUT_S = 120.0


def admin_routes(gateway: Gateway, read_json) -> list[Route]:
    supervisor = gateway.supervisor

    async def telemetry(request: Request) -> JSONResponse:
        gateway.authorize(request)
        instances = {}
        for g in supervisor.groups:
            ready = getattr(g, "ready", None)
            profile = ready.profile if ready is not None else None
            instances[g.name] = {"healthy": g.healthy, "in_flight": g.in_flight,
                                 "models": list(gateway.config.instances_by_name(g.name).models),
                                 "stats": asdict(g.stats) if getattr(g, "stats", None) is not None else None,
                                 "profile": dump_profile(profile) if profile is not None else None}
        router = gateway.dispatcher.router
        return JSONResponse({"time": router.clock(), "instances": instances, "router": router_telemetry(router)})

    async def switch(request: Request) -> JSONResponse:
        gateway.authorize(request)
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
        gateway.authorize(request)
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
