"""The gateway's side of routing: keeps the router's views current, names sessions, applies the
overload policy and reports completions.

`Dispatcher.place` turns a parsed request into a `Placement`: a local engine group or a peer node,
with the router's decision. Before each decision the views are refreshed from the supervisor's
groups (health, latest snapshot, profile); peers refresh their own views on a heartbeat
(`talaria/routing/peers.py`). A call without a session id gets one from the continuity index when
its conversation extends a recent call's, else a fresh one, so its next call can be recognised.
Route and lease events go to the node's event log with instance "router".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from talaria.config.schema import Overload, RouterConfig
from talaria.contracts.call import Usage
from talaria.contracts.events import Event, EventKind
from talaria.gateway.errors import RETRY_AFTER_S, APIError
from talaria.gateway.openai_protocol import Endpoint, ParsedRequest
from talaria.node.errors import InstanceUnavailable
from talaria.routing.continuity import (
    DEFAULT_PAGE,
    ContinuityIndex,
    assistant_message,
    extend_chain,
    message_chain,
    new_session_id,
    token_chain,
)
from talaria.routing.router import InstanceView, RouteDecision, Router, RouteRequest

if TYPE_CHECKING:
    from talaria.node.supervisor import Supervisor
    from talaria.routing.peers import PeerLink

QUEUE_POLL_S = 0.05  # overload = "queue": how often a held call asks the router again
RATE_LIMITED = "rate_limit_exceeded"


@dataclass(frozen=True, slots=True)
class Placement:
    request: RouteRequest
    decision: RouteDecision
    group: Any = None  # the local EngineGroup, or None when a peer serves the call
    peer: PeerLink | None = None
    chain: tuple[int, ...] = ()  # the conversation's hash chain, when the session was inferred
    inferred: bool = False
    endpoint: Endpoint = Endpoint.CHAT
    prompt_ids: tuple[int, ...] = ()


class Dispatcher:
    def __init__(self, supervisor: Supervisor, config: RouterConfig, clock: Callable[[], float]) -> None:
        self.supervisor = supervisor
        self.config = config
        self.clock = clock
        self.router = Router(config, clock, self._emit)
        self.continuity = ContinuityIndex(clock, config.session_ttl_s, config.max_sessions)
        self.peers: list[PeerLink] = []
        self._models = {inst.name: inst.models for inst in supervisor.config.instances}
        self._queued = 0

    # ---- views ------------------------------------------------------------------------------

    def sync(self) -> None:
        """Copy health, the newest snapshot and the profile of every local group into its view."""
        for g in self.supervisor.groups:
            view = self.router.views.get(g.name)
            if view is None:
                view = self.router.views[g.name] = InstanceView(g.name, tuple(self._models.get(g.name, ())))
            view.healthy = g.healthy
            view.in_flight = g.in_flight  # the group counts every call it runs
            ready = getattr(g, "ready", None)
            view.profile = ready.profile if ready is not None else None
            stats = getattr(g, "stats", None)
            if stats is not None:
                self.router.observe(g.name, stats, taken_at=stats.time)

    # ---- sessions ---------------------------------------------------------------------------

    def session(self, parsed: ParsedRequest, body: Any, endpoint: Endpoint) -> tuple[str, tuple[int, ...], bool]:
        """(session id, conversation chain, inferred?): the client's id, else continuity, else new."""
        if parsed.session_id is not None:
            return parsed.session_id, (), False
        if endpoint is Endpoint.CHAT:
            chain = message_chain(body.get("messages", ()))
        else:
            chain = token_chain(parsed.prompt_token_ids)
        found = self.continuity.lookup(parsed.model, chain)
        return found or new_session_id(), tuple(chain), True

    # ---- placement --------------------------------------------------------------------------

    async def place(self, parsed: ParsedRequest, endpoint: Endpoint, session: str, chain: Sequence[int],
                    inferred: bool, request_id: str, local: bool = False) -> Placement:
        """Where the call goes; raises APIError 429 when the overload policy turns it away."""
        req = RouteRequest(parsed.model, session, len(parsed.prompt_token_ids), parsed.sampling.max_tokens,
                           request_id)
        self.sync()
        decision = self.router.route(req, local)
        if decision.instance is None and self.config.overload is Overload.QUEUE:
            decision = await self._wait(req, local)
        if decision.instance is None and not any(v.healthy and parsed.model in v.models
                                                 for v in self.router.views.values()):
            names = ", ".join(v.name for v in self.router.views.values() if parsed.model in v.models)
            raise InstanceUnavailable(f"no healthy instance serves model {parsed.model!r} right now "
                                      f"({names or 'none configured'}); retry shortly")
        if decision.instance is None:
            raise APIError(429, f"every instance serving {parsed.model!r} is at capacity; retry in "
                           f"{RETRY_AFTER_S} s", "rate_limit_error", None, RATE_LIMITED,
                           {"Retry-After": str(RETRY_AFTER_S)})
        view = self.router.views[decision.instance]
        self.router.sent(view.name)
        if view.node is None:
            group = next(g for g in self.supervisor.groups if g.name == view.name)
            return Placement(req, decision, group, None, tuple(chain), inferred, endpoint, parsed.prompt_token_ids)
        peer = next(p for p in self.peers if p.url == view.node)
        return Placement(req, decision, None, peer, tuple(chain), inferred, endpoint, parsed.prompt_token_ids)

    async def _wait(self, req: RouteRequest, local: bool) -> RouteDecision:
        """overload = "queue": hold the call (bounded) and ask again until an instance admits it."""
        if self._queued >= self.config.max_queued:
            return RouteDecision(None, self.router.route(req, local).reason, overload="queue-full")
        self._queued += 1
        try:
            deadline = self.clock() + self.config.queue_timeout_s
            while self.clock() < deadline:
                await asyncio.sleep(QUEUE_POLL_S)
                self.sync()
                decision = self.router.route(req, local)
                if decision.instance is not None:
                    return decision
            return RouteDecision(None, decision.reason, overload="queue-timeout")
        finally:
            self._queued -= 1

    def finished(self, placement: Placement, usage: Usage | None, reply: str, output_ids: Sequence[int]) -> None:
        """The call ended; on a normal finish install the lease and remember the conversation."""
        self.router.finished(placement.decision.instance)
        if usage is None:
            return
        req = placement.request
        self.router.complete(req, placement.decision.instance, max(0, usage.prompt_tokens + usage.completion_tokens - 1))
        if placement.inferred and placement.chain:
            last = placement.chain[-1]
            if placement.endpoint is Endpoint.CHAT:  # the client appends our reply as an assistant message
                keys = [last, extend_chain(last, assistant_message(reply))]
            else:  # the next prompt starts with this prompt and our output: hash only what follows
                tail = placement.prompt_ids[len(placement.chain) * DEFAULT_PAGE:]  # after its last full page
                keys = [last, *token_chain([*tail, *output_ids], after=last)[-1:]]
            self.continuity.remember(req.model, req.session, keys)

    # ---- events -----------------------------------------------------------------------------

    def _emit(self, kind: str, **data) -> None:
        events = getattr(self.supervisor, "events", None)
        if events is not None:
            events.append([Event(self.clock(), "router", EventKind(kind), data)])
