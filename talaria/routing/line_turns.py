"""The dispatcher's side of the admission line (routing/admission_line.py): the 429 a new session
gets with its place and its promise, a held call's wait for its turn, the promises' schedule, and
each poll's check of the line. A part of `Dispatcher` (routing/dispatcher.py), kept apart so each
file reads as one responsibility: it uses the dispatcher's line, router, load, held calls and clock."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from talaria.routing.admission_line import (
    CONTROL_INTERVAL_S,
    GRACE_S,
    MAX_PROMISE_S,
    AdmissionLine,
    Waiting,
    promise_times,
)
from talaria.routing.decision import Reason, RouteDecision, RouteRequest
from talaria.routing.errors import RETRY_AFTER_S, Overloaded

TTFT_SLACK = 1.5  # a new session's first call, held in line, must still start within this many TTFT targets
# (issue 33: admitted calls' TTFT p95 within 1.5 x ttft_s)

if TYPE_CHECKING:
    from talaria.routing.costs import Cost
    from talaria.routing.held_calls import HeldCalls
    from talaria.routing.router import Router
    from talaria.routing.session_load import SessionLoad


class LineTurns:
    """New sessions' turns in the admission line, for `Dispatcher`, which provides what is declared here."""

    line: AdmissionLine
    router: Router
    load: SessionLoad
    held: HeldCalls
    clock: Callable[[], float]

    _poll: Callable[[], None]
    _commit: Callable[[RouteRequest, RouteDecision], None]
    _uncommit: Callable[[RouteRequest, RouteDecision], None]

    def _wait_in_line(self, req: RouteRequest, entry: Waiting | None, decision: RouteDecision,
                      now: float) -> Overloaded:
        """A new session that may not be placed now: its place in line (kept, or taken at the back)
        and its promise, as the 429 to send; beyond the line's bound a longer wait, or over capacity."""
        line = self.line
        if entry is None:
            entry = line.join(req.session, req.tenant, req.model, req.prompt_tokens, req.max_tokens, now)
        else:
            line.returned(entry)
        if entry is None:  # the line is full: come back once it has moved on
            last = max((w.promised_at for w in line.order(req.model)), default=now)
            wait = last - now
            if wait > MAX_PROMISE_S:
                line.counts["over_capacity"] += 1
                return Overloaded(f"over capacity: {line.limit} new sessions wait already (router.max_waiting) and "
                                  f"the last is not expected in before {MAX_PROMISE_S:.0f} s; retry later",
                                  math.ceil(MAX_PROMISE_S), over_capacity=True)
            return Overloaded(f"every instance serving {req.model!r} is at capacity for new sessions and "
                              f"{line.limit} wait already (router.max_waiting): this one (session {req.session}) "
                              f"has no place in line; retry in {max(1, math.ceil(wait))} s", max(1, math.ceil(wait)),
                              math.ceil(wait * 1000))
        self._poll()
        times = self._schedule(req, decision, entry, now)
        if not len(self.load.lengths(req.model)):
            # priced from the paper's session lengths, before any of this model's sessions ended: a guess
            # too rough to turn a client away on. Its place is kept, and it is asked back by MAX_PROMISE_S
            times = [min(t, now + MAX_PROMISE_S) for t in times]
        wait = line.promise(entry, times, now) - now
        if wait > MAX_PROMISE_S:  # longer than any client waits for its call: no place worth keeping
            line.drop(entry)
            line.counts["over_capacity"] += 1
            return Overloaded(f"over capacity: every instance serving {req.model!r} is full for new sessions and "
                              f"this one (session {req.session}) is not expected in within {MAX_PROMISE_S:.0f} s; "
                              f"retry later", math.ceil(MAX_PROMISE_S), over_capacity=True)
        place = line.order(req.model).index(entry) + 1
        return Overloaded(f"every instance serving {req.model!r} is at capacity for new sessions: this one (session "
                          f"{req.session}) is number {place} in line, expected in within {wait:.1f} s; its place is "
                          f"kept until then (Retry-After)", max(1, math.ceil(wait)), math.ceil(wait * 1000))

    async def _wait_turn(self, entry: Waiting, req: RouteRequest, local: bool, hold_s: float,
                         left: Callable[[], Awaitable[object]] | None) -> RouteDecision:
        """Hold a new session's call, its turn near, until `_check_line` places it, it has been held
        `hold_s` (`_hold_s`) or is GRACE_S past its promise (a decision without an instance: it gets its
        429), or its client leaves ("client-gone")."""
        waiter = asyncio.get_running_loop().create_future()
        until = min(entry.promised_at + GRACE_S, max(entry.promised_at, self.clock() + hold_s))
        entry.held, entry.hold_until = (req, local, waiter), until
        self._poll()
        watch = asyncio.ensure_future(left()) if left is not None else None
        try:
            if watch is not None:
                await asyncio.wait((waiter, watch), return_when=asyncio.FIRST_COMPLETED)
                if not waiter.done():  # its client left first: its place is kept, should it come back
                    waiter.cancel()
                    return RouteDecision(None, Reason.OVERLOAD, overload="client-gone")
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result().instance is not None:
                self._uncommit(req, waiter.result())  # placed just as its client left: it never runs
            raise
        finally:
            if watch is not None:
                watch.cancel()
            entry.held = None

    def _hold_s(self, decision: RouteDecision) -> float:
        """How long a new session's call may be held for its turn: `line_hold_s`, and no longer than lets
        its first token still come within TTFT_SLACK times its instance's TTFT target (once placed it
        may wait up to that target behind the admitted sessions, or its own prefill where longer): a
        held call's wait is part of the time to first token its client sees. The head of its line
        back when it was told is no exception: holding it until the sessions predicted to leave had
        called once more and gone quiet spared its client a retry but cost seconds of its first token
        (patient workload, 6a6bcb1: 16 of 77 first calls over 3 s, all held, p95 11.7 s)."""
        cost = decision.cost
        view = self.router.views.get(cost.instance) if cost is not None else None
        if view is None or view.ttft_s is None:
            return self.line.hold_s
        start = max(view.ttft_s, cost.prefill_s + cost.c_kv_s)
        return max(0.0, min(self.line.hold_s, TTFT_SLACK * view.ttft_s - start))

    def _schedule(self, req: RouteRequest, decision: RouteDecision, entry: Waiting, now: float) -> list[float]:
        """Predicted admission times of the model's line, in order (AdmissionLine.promise_times), on
        the instance closest to admitting `entry`'s call `req` (`decision`, the router's answer to it)."""
        model, cost = req.model, decision.cost
        order = self.line.order(model)
        if cost is None:  # nothing priced it (no fresh snapshot): the default wait, then ask again
            return [now + RETRY_AFTER_S] * len(order)
        x, entry.charge_s, lifetime = self._priced(req, cost)
        excess = decision.wait_s or 0.0
        if decision.overload == "line":  # an instance admits it, the line held it back: the room left there
            excess = min(0.0, self.router.costs.excess_s(self.router.views[cost.instance], req, cost, signed=True))
        times = promise_times(now, excess, self.load.departures(cost.instance, x, now),
                              self.line.expected_charges(order, entry.charge_s), lifetime, self.line.scale(model))
        # work ahead that no admitted session accounts for (the snapshot's queue, a switch): about its own length
        return [t if t != math.inf else now + max(1.0, excess * self.line.scale(model)) for t in times]

    def _priced(self, req: RouteRequest, cost: Cost) -> tuple[float, float, float]:
        """A new session's call `req`, priced `cost`: the prefill it is admitted against; once in, what
        it holds back the sessions after it by (its next call, as long as its first, at most that
        prefill, as likely as the model's sessions make a second call: session_load.py charges its tool
        gap so); and for how long it is expected to."""
        x = self.load.on(cost.instance).admit_x(req.model, cost.prefill_s + cost.c_kv_s)
        charge = min(x, cost.prefill_s + cost.decode_s) * self.load.lengths(req.model).second_call()
        return x, charge, self.load.lifetime_s(cost.prefill_s + cost.decode_s, req.model)

    def _keeps_promises(self, req: RouteRequest, decision: RouteDecision, entry: Waiting | None,
                        now: float) -> bool:
        """Would placing `req` now, a new session's call that an instance admits (`decision`) but that
        is neither due nor first in line, keep every promise made to the others in line? With it in,
        each must still be predicted in by its promise (or now, one whose client is late). Room that
        no promise needs goes to whoever asks, as a batch scheduler backfills the gaps before a
        reservation: an idle node never turns a session away for places kept by clients that may not
        come back, and nobody in line waits past what it was told."""
        cost, model = decision.cost, req.model
        if cost is None:
            return False
        others = [w for w in self.line.order(model) if w is not entry]
        x, charge, lifetime = self._priced(req, cost)
        room = -self.router.costs.excess_s(self.router.views[cost.instance], req, cost, signed=True)
        departures = [*self.load.departures(cost.instance, x, now), (now + lifetime, charge)]
        times = promise_times(now, charge - room, departures, self.line.expected_charges(others, charge), lifetime,
                              self.line.scale(model))
        return all(t <= max(w.promised_at, now) + CONTROL_INTERVAL_S for t, w in zip(times, others, strict=True))

    def _check_line(self) -> None:
        """Each poll: drop the line's sessions whose clients did not come back; place the calls held
        in line (in its order, while they are due or first and an instance admits them); and note the
        first poll at which an instance would admit the head of each line (its promise's error)."""
        now, line = self.clock(), self.line
        line.expire(now)
        for w in line:
            if w.held is not None and now >= w.hold_until and not w.held[2].done():
                w.held[2].set_result(RouteDecision(None, Reason.OVERLOAD, overload="line"))  # 429 after all
        for head in line.heads():
            if self.held.blocks(head.model, False):
                continue
            for w in line.order(head.model):
                if w.held is None or w.held[2].done():
                    continue  # its client is away: one behind it that is due may go first
                req, local, waiter = w.held
                if not line.may_try(w, head.model, now):
                    break  # the ones behind it are due later still
                decision = self.router.decide(req, local)
                if decision.instance is None:
                    break  # no room: the ones behind it wait behind it
                self.router.record(req, decision)
                self._commit(req, decision)
                line.admitted(w, now)
                waiter.set_result(decision)
            if head.ready_at is not None or line.get(head.session) is not head:
                continue
            probe = RouteRequest(head.model, None, head.prompt_tokens, head.max_tokens, "", head.tenant, True)
            if self.router.decide(probe).instance is not None:
                self.line.ready(head, now)
