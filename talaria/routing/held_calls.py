"""Calls held at the gateway until an instance admits them, placed oldest first.

`overload = "sessions"` holds the calls of admitted sessions (new sessions wait in the admission
line, talaria/routing/admission_line.py); `overload = "queue"` holds every call. When an instance frees up,
the call placed is the oldest one held for its model, not whichever asks first: `pump` walks the
calls in arrival order and, per model,

- once an admitted session's call (or any call under "queue") cannot be placed, places no later call
  of that model: they would take the room it waits for;
- once a new session cannot be placed, places no later new session of that model, but still the
  admitted sessions' calls behind it: a new session waits for room in the TTFT target, an admitted
  one only for room in the round-admission bound, and admitted sessions come first.

A call arriving while older calls of its class (or above) wait for its model joins the back
(`blocks`). Each call has a deadline: its predicted wait (how far past admission the closest
instance is, and the work of the calls ahead of it), `queue_timeout_s` of slack for the prediction's
error, and at most MAX_HOLD_S in all; `max_queued` calls at most are held at once. The clock and the
placing are the caller's: this is a list and a walk over it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from talaria.routing.decision import RouteDecision, RouteRequest

MAX_HOLD_S = 600.0  # the OpenAI and Anthropic SDKs' default request timeout: held longer, nobody waits for it


@dataclass(slots=True, eq=False)
class HeldCall:
    req: RouteRequest
    local: bool  # only this node's instances (a call a peer forwarded here)
    admitted: bool  # an admitted session's call (any call under "queue"): placed before new sessions
    held_at: float
    deadline: float
    work_s: float  # its predicted work once placed: what it adds to the wait of the calls behind it
    decision: RouteDecision | None = None  # the latest answer it got (why it still waits)
    waiter: Any = field(default=None)  # the caller's handle on it (an asyncio future)


class HeldCalls:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._calls: list[HeldCall] = []  # arrival order

    def hold(self, call: HeldCall) -> bool:
        """Append `call`; False when `limit` calls are held already."""
        if len(self._calls) >= self.limit:
            return False
        self._calls.append(call)
        return True

    def remove(self, call: HeldCall) -> None:
        """Its client left, or it was answered."""
        if call in self._calls:
            self._calls.remove(call)

    def blocks(self, model: str, admitted: bool) -> bool:
        """A new call of `model` must join the back: older calls it may not overtake are held."""
        return any(c.req.model == model and (c.admitted or not admitted) for c in self._calls)

    def ahead_s(self, model: str, admitted: bool) -> float:
        """The predicted work of the held calls of `model` a new call of its class would wait behind."""
        return sum(c.work_s for c in self._calls if c.req.model == model and (c.admitted or not admitted))

    def pump(self, place: Callable[[HeldCall], RouteDecision | None],
             now: float) -> tuple[list[tuple[HeldCall, RouteDecision]], list[HeldCall]]:
        """Offer the held calls, oldest first, to `place` (a decision when an instance admits the call,
        None when none does) under the order rules above, and drop those past their deadline.
        Returns (placed with their decisions, expired); both leave the list."""
        placed, expired, kept = [], [], []
        stopped: set[str] = set()  # models whose admitted calls wait: nothing later is placed
        stopped_new: set[str] = set()  # models whose new sessions wait: no later new session is placed
        for call in self._calls:
            model = call.req.model
            if call.deadline <= now:
                expired.append(call)
                continue
            if model in stopped or (not call.admitted and model in stopped_new):
                kept.append(call)
                continue
            decision = place(call)
            if decision is not None:
                placed.append((call, decision))
                continue
            (stopped if call.admitted else stopped_new).add(model)
            kept.append(call)
        self._calls = kept
        return placed, expired

    def __len__(self) -> int:
        return len(self._calls)

    def __iter__(self):
        return iter(self._calls)
