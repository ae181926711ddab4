"""The gateway's side of routing: keeps the router's views current, names sessions, applies the
overload policy and reports completions.

`Dispatcher.place` turns a request into a `Placement`: a local instance or a peer node, with the
router's decision. Before each decision the views are refreshed from the node's instances (health,
latest snapshot, profile); peers refresh their own views on a heartbeat
(`talaria/routing/peers.py`). A call without a session id gets one from the continuity index when
its conversation extends a recent call's, else a fresh one, so its next call can be recognised.
Route and lease events go to the node's event log with instance "router".

Overload (`[router] overload`): under "sessions" (the default) a call whose session was not admitted
within `session_ttl_s` opens a session, and is admitted only in its turn (`AdmissionLine`: while new
sessions wait for its model, one that is due or first, or one that room no promise needs lets in
ahead: `LineTurns._keeps_promises`) and where the sessions already admitted
there (`SessionLoad`: their calls and the next calls of those in tool gaps) leave its first call
within the TTFT target; otherwise it keeps or takes a place in line and gets 429 with the line's
promise as Retry-After. Calls of admitted sessions that no instance admits yet are held, and placed
oldest first (`HeldCalls`). Every poll the head of each line is checked (its promise's error, which
corrects the next promises), and each new session's first token corrects the load it was admitted
against (`InstanceLoad.observe_start`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from talaria.config.schema import Overload, RouterConfig
from talaria.contracts.call import Usage
from talaria.contracts.events import Event, EventKind
from talaria.contracts.instance_handle import InstanceHandle
from talaria.node.errors import InstanceUnavailable
from talaria.routing.admission_line import AdmissionLine, Waiting
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
from talaria.routing.decision import Reason, RouteDecision, RouteRequest
from talaria.routing.errors import RETRY_AFTER_S, Overloaded
from talaria.routing.held_calls import MAX_HOLD_S, HeldCall, HeldCalls
from talaria.routing.instance_view import InstanceView
from talaria.routing.line_turns import LineTurns
from talaria.routing.router import Router
from talaria.routing.session_load import SessionLoad
from talaria.routing.shedding import SessionShedding

if TYPE_CHECKING:
    from talaria.node.node_handle import NodeHandle
    from talaria.routing.peers import PeerLink

QUEUE_POLL_S = 0.05  # held calls (overload = "queue" or "sessions") are offered to the router again this often


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


class Dispatcher(LineTurns):
    def __init__(self, node: NodeHandle, config: RouterConfig, clock: Callable[[], float]) -> None:
        self.node = node
        self.config = config
        self.clock = clock
        self.router = Router(config, clock, self._emit)
        self.continuity = ContinuityIndex(clock, config.session_ttl_s, config.max_sessions)
        self.shedding = SessionShedding(clock, config.session_ttl_s, config.max_sessions)
        self.load = SessionLoad(self._price, config.session_ttl_s)
        self.held = HeldCalls(config.max_queued)
        self.line = AdmissionLine(config.max_waiting, config.line_hold_s)
        self.peers: list[PeerLink] = []
        self._models = {inst.name: inst.models for inst in node.config.instances}
        self._ttft = {inst.name: inst.ttft_s for inst in node.config.instances}
        self._pumping: asyncio.Task | None = None

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
            view.ttft_s = self._ttft.get(g.name)
            stats = g.stats
            if stats is not None:
                self.router.observe(g.name, stats, taken_at=stats.time)
        self.load.sweep(self.clock())
        for view in self.router.views.values():
            if view.load is None:  # peers' views appear on their heartbeat: they get theirs on the next call
                view.load = self.load.on(view.name)

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
                    prompt_ids: tuple[int, ...], local: bool = False,
                    left: Callable[[], Awaitable[object]] | None = None) -> Placement:
        """Where the call goes. Raises InstanceUnavailable when no healthy instance serves the model,
        Overloaded when the overload policy turns the call away. `left`: returns once the client has
        gone (a held call is then dropped). A call a peer forwarded (`local`) was admitted there: it
        never opens a session here."""
        self.sync()
        policy, router, now = self.config.overload, self.router, self.clock()
        admitted = True  # a call of an admitted session (any call but under "sessions")
        entry: Waiting | None = None  # its place in the admission line, if it has one
        if policy is Overload.SESSIONS and req.session is not None and not local:
            if self.shedding.known(req.session):
                self.load.arrived(req.session, req.model, req.prompt_tokens, now)
            else:
                req, admitted = dataclasses.replace(req, new_session=True), False
                self.line.expire(now)
                entry = self.line.get(req.session)
        router.arrived(req)
        if self.held.blocks(req.model, admitted):
            self.pump()  # room may have freed since the last tick: the older calls go first
        if self.held.blocks(req.model, admitted):  # older calls wait for the room it would take: behind them
            decision = RouteDecision(None, Reason.OVERLOAD, overload=policy.value,
                                     wait_s=self.held.ahead_s(req.model, admitted))
            if not admitted:  # priced all the same: its place in line is predicted from the closest instance
                priced = router.decide(req, local)
                decision.cost, decision.wait_s = priced.cost, max(decision.wait_s, priced.wait_s or 0.0)
        else:
            decision = router.decide(req, local)
        if (not admitted and decision.instance is not None and not self.line.may_try(entry, req.model, now)
                and not self._keeps_promises(req, decision, entry, now)):
            # an instance has room, but sessions ahead in line were promised it: this one waits behind them
            decision = RouteDecision(None, Reason.OVERLOAD, decision.cost, overload="line", wait_s=0.0)
        if decision.instance is not None:
            router.record(req, decision)
            self._commit(req, decision)
            if entry is not None:
                self.line.admitted(entry, now)
        elif not any(v.healthy and req.model in v.models for v in router.views.values()):
            router.record(req, decision)
            names = ", ".join(v.name for v in router.views.values() if req.model in v.models)
            raise InstanceUnavailable(f"no healthy instance serves model {req.model!r} right now "
                                      f"({names or 'none configured'}); retry shortly")
        elif policy is Overload.QUEUE or (policy is Overload.SESSIONS and admitted):
            decision = await self._hold(req, local, admitted, decision, left)
        elif not admitted:
            if inferred and chain:  # a client without a session id is known again by its conversation
                self.continuity.remember(req.model, req.session, chain[-1:])
            refusal = self._wait_in_line(req, entry, decision, now)
            entry = self.line.get(req.session)
            hold = self._hold_s(decision)
            if entry is None or refusal.over_capacity or entry.promised_at - now > hold:
                router.record(req, decision)
                raise refusal
            decision = await self._wait_turn(entry, req, local, hold, left)  # its turn is near: it waits here
            if decision.instance is None:
                router.record(req, decision)
                entry = self.line.get(req.session)
                if decision.overload == "client-gone" or entry is None:
                    raise self._refusal(req, decision)
                raise self._wait_in_line(req, entry, router.decide(req, local), self.clock())
        else:
            router.record(req, decision)
        if decision.instance is None:
            raise self._refusal(req, decision)
        view = router.views[decision.instance]
        if view.node is None:
            group = next(g for g in self.node.groups if g.name == view.name)
            return Placement(req, decision, group, None, tuple(chain), inferred, chat, prompt_ids)
        peer = next(p for p in self.peers if p.url == view.node)
        return Placement(req, decision, None, peer, tuple(chain), inferred, chat, prompt_ids)

    # ---- held calls -------------------------------------------------------------------------

    async def _hold(self, req: RouteRequest, local: bool, admitted: bool, decision: RouteDecision,
                    left: Callable[[], Awaitable[object]] | None = None) -> RouteDecision:
        """Hold the call until the router admits it, it has waited its predicted wait and
        `queue_timeout_s` more (MAX_HOLD_S at most), or its client leaves (`left` returns, or the
        caller is cancelled)."""
        now = self.clock()
        wait = decision.wait_s or 0.0
        work = self._work(req, decision.cost.instance if decision.cost is not None else None)
        call = HeldCall(req, local, admitted, now, now + min(MAX_HOLD_S, wait + self.config.queue_timeout_s),
                        work, decision)
        if not self.held.hold(call):
            full = RouteDecision(None, decision.reason, decision.cost, overload="queue-full", wait_s=wait)
            self.router.record(req, full)
            return full
        call.waiter = asyncio.get_running_loop().create_future()
        self._poll()
        watch = asyncio.ensure_future(left()) if left is not None else None
        try:
            if watch is not None:
                await asyncio.wait((call.waiter, watch), return_when=asyncio.FIRST_COMPLETED)
                if not call.waiter.done():  # its client left first
                    call.waiter.cancel()
                    gone = RouteDecision(None, Reason.OVERLOAD, overload="client-gone")
                    self.router.record(req, gone)
                    return gone
            return await call.waiter
        except asyncio.CancelledError:
            if call.waiter.done() and not call.waiter.cancelled() and call.waiter.result().instance is not None:
                self._uncommit(req, call.waiter.result())  # placed just as its client left: it never runs
            raise
        finally:
            if watch is not None:
                watch.cancel()
            self.held.remove(call)

    async def _pump_every_poll(self) -> None:
        while len(self.held) or len(self.line):
            await asyncio.sleep(QUEUE_POLL_S)
            self.pump()

    def _poll(self) -> None:
        """Make sure held calls and the line are looked at every QUEUE_POLL_S."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller, tests): it calls pump itself
            return
        if self._pumping is None or self._pumping.done():
            self._pumping = loop.create_task(self._pump_every_poll())

    def pump(self) -> None:
        """Offer the held calls to the router, oldest first (talaria/routing/held_calls.py); answer
        those placed and those past their deadline. Then look at the head of each admission line."""
        for call in [c for c in self.held if c.waiter is not None and c.waiter.done()]:
            self.held.remove(call)  # its client left
        if len(self.line):
            self.sync()
            self._check_line()
        if not len(self.held):
            return
        self.sync()
        placed, expired = self.held.pump(self._ask, self.clock())
        for call, decision in placed:
            if call.waiter is not None:
                call.waiter.set_result(decision)
        for call in expired:
            last = call.decision
            out = RouteDecision(None, Reason.OVERLOAD, last.cost if last else None, overload="queue-timeout",
                                wait_s=last.wait_s if last else None)
            self.router.record(call.req, out)
            if call.waiter is not None:
                call.waiter.set_result(out)

    def _ask(self, call: HeldCall) -> RouteDecision | None:
        decision = self.router.decide(call.req, call.local)
        if decision.instance is None:
            call.decision = decision
            return None
        self.router.record(call.req, decision)
        self._commit(call.req, decision)  # now, so that the next call asked sees it
        return decision

    # ---- the admission line -------------------------------------------------------------------

    def telemetry(self) -> dict:
        """The router's telemetry, the admission line and what admission has learned."""
        out = self.router.telemetry()
        out["line"] = self.line.telemetry(self.clock())
        out["session_lengths"] = self.load.telemetry()
        for name, view in out["views"].items():
            load = self.router.views[name].load
            if load is not None:
                view["ttft_scale"], view["ttft_samples"] = round(load.scale, 3), load.samples
        return out

    # ---- bookkeeping of a placement -----------------------------------------------------------

    def _commit(self, req: RouteRequest, decision: RouteDecision) -> None:
        """The call goes to `decision.instance`: count it there before any other decision is made."""
        name = decision.instance
        self.router.sent(name)
        self.shedding.admitted(req.session, req.tenant)
        if req.session is not None:
            self.load.placed(req.session, req.model, name, self._work(req, name),
                             req.prompt_tokens + req.max_tokens, self.clock())

    def _uncommit(self, req: RouteRequest, decision: RouteDecision) -> None:
        self.router.finished(decision.instance)
        if req.session is not None:
            self.load.failed(req.session, req.model, self.clock())

    def _work(self, req: RouteRequest, instance: str | None) -> float:
        """The call's predicted work on `instance` (its prefix reused there if its last call was);
        `instance` None: where its session was last served, else the first instance serving its model."""
        last = self.router.sessions.get(req.session, req.model) if req.session is not None else None
        if instance is None:
            instance = last.instance if last is not None else next(
                (v.name for v in self.router.views.values() if req.model in v.models), None)
        view = self.router.views.get(instance) if instance is not None else None
        if view is None:
            return 0.0
        reusable = last.kv_tokens if last is not None and last.instance == instance else 0
        return self.router.costs.work_s(view, req.model, req.prompt_tokens, reusable, req.max_tokens) or 0.0

    def _price(self, instance: str, model: str, prompt: int, reusable: int, max_tokens: int,
               footprint: int) -> float | None:
        view = self.router.views.get(instance)
        return None if view is None else self.router.costs.work_s(view, model, prompt, reusable, max_tokens, footprint)

    def _refusal(self, req: RouteRequest, decision: RouteDecision) -> Overloaded:
        wait = decision.wait_s
        retry = RETRY_AFTER_S if wait is None else max(1, math.ceil(wait))
        what = f"every instance serving {req.model!r} is at capacity"
        if decision.overload == "queue-full":
            why = f"{what}: {self.config.max_queued} calls are held already (router.max_queued)"
        elif decision.overload == "queue-timeout":
            why = f"{what}: the call was held past its predicted wait"
        elif decision.overload == "client-gone":
            why = "the client left while its call was held"
        elif req.new_session:
            why = f"{what} for new sessions: the sessions it has admitted fill its TTFT target"
        else:
            why = what
        return Overloaded(f"{why}; retry in {retry} s", retry)

    def finished(self, placement: Placement, usage: Usage | None, reply: Mapping[str, Any] | None,
                 output_ids: Sequence[int], ttft_s: float | None = None) -> None:
        """The call ended; on a normal finish install the lease and remember the conversation.
        `reply`: a chat call's answer as the assistant message the client appends to it. `ttft_s`:
        its arrival to its first token; a new session's corrects the load admission counts there."""
        instance, req, now = placement.decision.instance, placement.request, self.clock()
        self.router.finished(instance)
        cost, view = placement.decision.cost, self.router.views.get(instance)
        if ttft_s is not None and req.new_session and cost is not None and view is not None and view.load is not None:
            view.load.observe_start(cost.start_s, ttft_s)
        if usage is None:
            if req.session is not None:
                self.load.failed(req.session, req.model, now)
            self.pump()  # room freed
            return
        self.router.complete(req, instance, max(0, usage.prompt_tokens + usage.completion_tokens - 1))
        if req.session is not None:
            self.load.completed(req.session, req.model, instance, usage.prompt_tokens, usage.completion_tokens,
                                req.max_tokens, now)
        self.pump()
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
