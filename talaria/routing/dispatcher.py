"""The gateway's side of routing: keeps the router's views current, names sessions, applies the
overload policy and reports completions.

`Dispatcher.place` turns a request into a `Placement`: a local instance or a peer node, with the
router's decision. Before each decision the views are refreshed from the node's instances (health,
latest snapshot, profile); peers refresh their own views on a heartbeat
(`talaria/routing/peers.py`). A call without a session id gets one from the continuity index when
its conversation extends a recent call's, else a fresh one, so its next call can be recognised.
Route and lease events go to the node's event log with instance "router".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from talaria.config.schema import Overload, RouterConfig
from talaria.contracts.call import Usage
from talaria.contracts.events import Event, EventKind
from talaria.contracts.instance_handle import InstanceHandle
from talaria.node.errors import InstanceUnavailable
from talaria.routing.continuity import (
    DEFAULT_PAGE,
    MESSAGE_ROOT,
    TOKEN_ROOT,
    ContinuityIndex,
    extend_chain,
    message_chain,
    namespaced,
    new_session_id,
    token_chain,
)
from talaria.routing.decision import RouteDecision, RouteRequest
from talaria.routing.errors import RETRY_AFTER_S, Overloaded
from talaria.routing.instance_view import InstanceView
from talaria.routing.router import Router
from talaria.routing.shedding import SessionShedding

if TYPE_CHECKING:
    from talaria.node.node_handle import NodeHandle
    from talaria.routing.peers import PeerLink

QUEUE_POLL_S = 0.05  # a held call (overload = "queue" or "sessions") asks the router again this often


@dataclass(frozen=True, slots=True)
class Placement:
    request: RouteRequest
    decision: RouteDecision
    group: InstanceHandle | None = None  # the local instance, or None when a peer serves the call
    peer: PeerLink | None = None
    chain: tuple[int, ...] = ()  # the conversation's hash chain, when the session was inferred
    inferred: bool = False
    chat: bool = True  # the prompt is a message list (else a token prompt): how the next call continues it
    prompt_ids: tuple[int, ...] = ()


class Dispatcher:
    def __init__(self, node: NodeHandle, config: RouterConfig, clock: Callable[[], float]) -> None:
        self.node = node
        self.config = config
        self.clock = clock
        self.router = Router(config, clock, self._emit)
        self.continuity = ContinuityIndex(clock, config.session_ttl_s, config.max_sessions)
        self.shedding = SessionShedding(clock, config.session_ttl_s, config.max_sessions)
        self.peers: list[PeerLink] = []
        self._models = {inst.name: inst.models for inst in node.config.instances}
        self._queued = 0

    # ---- views ------------------------------------------------------------------------------

    def sync(self) -> None:
        """Copy health, the newest snapshot and the profile of every local instance into its view."""
        for g in self.node.groups:
            view = self.router.views.get(g.name)
            if view is None:
                view = self.router.views[g.name] = InstanceView(g.name, tuple(self._models.get(g.name, ())))
            view.healthy = g.healthy
            view.in_flight = g.in_flight  # the instance counts every call it runs
            view.profile = g.ready.profile if g.ready is not None else None
            stats = g.stats
            if stats is not None:
                self.router.observe(g.name, stats, taken_at=stats.time)

    # ---- sessions ---------------------------------------------------------------------------

    def session(self, model: str, session_id: str | None, messages: Sequence[Any] | None,
                prompt_ids: Sequence[int], namespace: str | None = None) -> tuple[str, tuple[int, ...], bool]:
        """(session id, conversation chain, inferred?): the client's id, else continuity, else new.
        `messages`: a chat call's message list (its conversation is recognised by them), None for a
        token prompt (recognised by its tokens). `namespace`: the call's tenant and cache salt (None
        for the default tenant unsalted): ids and conversations of other namespaces are never its."""
        if session_id is not None:
            return (f"{namespace}/{session_id}" if namespace else session_id), (), False
        if messages is not None:
            chain = message_chain(messages, namespaced(MESSAGE_ROOT, namespace))
        else:
            chain = token_chain(prompt_ids, after=namespaced(TOKEN_ROOT, namespace))
        found = self.continuity.lookup(model, chain)
        return found or new_session_id(), tuple(chain), True

    # ---- placement --------------------------------------------------------------------------

    async def place(self, req: RouteRequest, chain: Sequence[int], inferred: bool, chat: bool,
                    prompt_ids: tuple[int, ...], local: bool = False) -> Placement:
        """Where the call goes. Raises InstanceUnavailable when no healthy instance serves the model,
        Overloaded when the overload policy turns the call away."""
        self.sync()
        decision = self.router.route(req, local)
        if decision.instance is None and not any(v.healthy and req.model in v.models
                                                 for v in self.router.views.values()):
            names = ", ".join(v.name for v in self.router.views.values() if req.model in v.models)
            raise InstanceUnavailable(f"no healthy instance serves model {req.model!r} right now "
                                      f"({names or 'none configured'}); retry shortly")
        if decision.instance is None and (self.config.overload is Overload.QUEUE or (
                self.config.overload is Overload.SESSIONS and self.shedding.waits(req.session, req.tenant))):
            decision = await self._wait(req, local)
        if decision.instance is None:
            raise Overloaded(f"every instance serving {req.model!r} is at capacity; retry in {RETRY_AFTER_S} s")
        view = self.router.views[decision.instance]
        self.router.sent(view.name)
        self.shedding.admitted(req.session, req.tenant)
        if view.node is None:
            group = next(g for g in self.node.groups if g.name == view.name)
            return Placement(req, decision, group, None, tuple(chain), inferred, chat, prompt_ids)
        peer = next(p for p in self.peers if p.url == view.node)
        return Placement(req, decision, None, peer, tuple(chain), inferred, chat, prompt_ids)
    async def _wait(self, req: RouteRequest, local: bool) -> RouteDecision:
        """overload = "queue" (any call) or "sessions" (a call it keeps): hold the call (bounded) and
        ask again until an instance admits it."""
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

    def finished(self, placement: Placement, usage: Usage | None, reply: Mapping[str, Any] | None,
                 output_ids: Sequence[int]) -> None:
        """The call ended; on a normal finish install the lease and remember the conversation.
        `reply`: a chat call's answer as the assistant message the client appends to it."""
        self.router.finished(placement.decision.instance)
        if usage is None:
            return
        req = placement.request
        self.router.complete(req, placement.decision.instance, max(0, usage.prompt_tokens + usage.completion_tokens - 1))
        if placement.inferred and placement.chain:
            last = placement.chain[-1]
            if placement.chat:  # the client appends our reply as an assistant message
                keys = [last] if reply is None else [last, extend_chain(last, reply)]
            else:  # the next prompt starts with this prompt and our output: hash only what follows
                tail = placement.prompt_ids[len(placement.chain) * DEFAULT_PAGE:]  # after its last full page
                keys = [last, *token_chain([*tail, *output_ids], after=last)[-1:]]
            self.continuity.remember(req.model, req.session, keys)

    # ---- events -----------------------------------------------------------------------------

    def _emit(self, kind: EventKind, **data) -> None:
        self.node.events.append([Event(self.clock(), "router", kind, data)])
