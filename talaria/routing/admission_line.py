"""New sessions waiting their turn (`overload = "sessions"`): an honest Retry-After, kept.

A new session that no instance admits within its TTFT target (talaria/routing/costs.py) is not
just shed: it takes a place in its model's line and is told when to come back (`Retry-After`). The
line is a list; its client is not held (a 429 costs the node nothing while the client waits, and
agent harnesses back off on `Retry-After`). What the line keeps:

- **Order.** Arrival order with per-tenant fairness: start-time fair queuing with equal weights,
  each session ordered by (its round, its arrival), its round one past its tenant's previous waiting
  session's, and never before the round being served. A tenant that floods the line with new
  sessions waits behind one session of every other tenant per round, never all of theirs.
- **A place kept.** A client that comes back keeps its place (keyed by its session). While the
  line holds sessions for a model, a call may open a session of it if it is due (its promised time
  has come, within one control interval) or first in line; another arrival goes in ahead only into
  room that no promise needs (the dispatcher's `_keeps_promises`), else it joins the back. So a
  client that comes back when it was told is admitted then, whoever arrived after it.
- **Clients that do not come back.** A place whose client has not been back yet is counted at the
  share of the model's recent places whose clients came back for them (`comes_back`), in full once
  its client has been back: a line of clients that never retry stops reserving room for them.
- **A promise.** Its Retry-After is the predicted time until an instance admits it at its TTFT
  target (`promise_times`): the admitted sessions' expected departures (talaria/routing/
  session_load.py: calls left from the session lengths the router has seen, a turn each, then quiet)
  free what they hold back a new call by; each session ahead in the line, once in, adds its own.
  Rounded up to whole seconds in `Retry-After`, exact in `retry-after-ms`.
- **Held when near.** A session whose turn is near when it asks is not sent away: its call is held
  at the gateway and placed, in line order, at the first control interval at which it is due (or
  first) and an instance admits it; if that has not happened in time (GRACE_S after its promise at
  the latest), it gets its 429 with a new promise after all. Near is within `hold_s` (`[router]
  line_hold_s`) and, the hold being part of its time to first token, within what keeps that first
  token inside 1.5 TTFT targets (talaria/routing/line_turns.py, `_hold_s`).
- **Bounded.** At most `limit` sessions wait. Beyond that a newcomer is not placed in line: a 429
  says so, with the wait until the line's last promise (the line will have moved by then); or, when
  that is past MAX_PROMISE_S, a 503 "over capacity".
- **Honest.** A client that does not come back within GRACE_S of its promise loses its place. Each
  control interval the head of each line is checked: the first interval at which an instance would
  admit it measures the promise's error (`ready`), and its model's `scale`, an EWMA of actual over
  promised waits with the cost model's gain, stretches or shrinks that line's later promises (one
  per model: each line's errors come from its own model's sessions).

The clock and the pricing are the caller's (talaria/routing/dispatcher.py): this is a list, a sort
key and a small event walk.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from talaria.routing.session_lengths import ALPHA

CONTROL_INTERVAL_S = 0.05  # the dispatcher's poll (QUEUE_POLL_S): how often the line is looked at
GRACE_S = 5.0  # past its promise, a client not back loses its place: Retry-After rounds up to whole
# seconds, and a client's own latency and an SDK's jitter come on top
MAX_PROMISE_S = 600.0  # a wait longer than the OpenAI and Anthropic SDKs' request timeout: over capacity
SCALE_BOUNDS = (0.25, 4.0)  # actual / promised wait: one odd sample must not throw every promise
ERRORS_KEPT = 256  # recent promise errors in telemetry
PLACES_KEPT = 32  # recent places in line ended (taken, or lost by a client that did not come back), per model


@dataclass(slots=True, eq=False)
class Waiting:
    """One new session in line."""

    session: str
    tenant: str
    model: str
    prompt_tokens: int  # its first call's: what a check of the head prices
    max_tokens: int
    seq: int  # arrival order
    round: int  # fair-queuing round (see the module docstring)
    arrived_at: float
    charge_s: float = 0.0  # what it will hold back a later new session's first call by, once in
    promised_at: float = 0.0  # when it was last told to come back
    promised_from: float = 0.0  # when that promise was made
    returns: int = 0  # times its client came back and was told to wait again
    ready_at: float | None = None  # the first control interval at which an instance would admit it
    held: Any = field(default=None)  # while its client waits at the gateway: (its call, its future)
    hold_until: float = 0.0  # then: when it is sent its 429 after all

    @property
    def key(self) -> tuple[int, int]:
        return self.round, self.seq


def promise_times(now: float, excess_s: float, departures: list[tuple[float, float]], charges: list[float],
                  lifetime_s: float, scale: float = 1.0) -> list[float]:
    """When each of a line's sessions (their `charges`, in line order) is predicted to be admitted.

    `excess_s`: how far the closest instance is past admitting the head now (0: it would now;
    negative: it would, with that much room left, which the sessions after the head may take too).
    `departures`: (when, how much less it holds back) per admitted session, any order. Sessions
    leave in time order; each admission adds its charge and, `lifetime_s` later, takes it away again.
    A line longer than any departure can make room for gets infinity. `scale` stretches every wait."""
    heap = list(departures)
    heapq.heapify(heap)
    need, t, out = excess_s, now, []
    for charge in charges:
        while need > 1e-9 and heap:
            when, freed = heapq.heappop(heap)
            t, need = max(t, when), need - freed
        if need > 1e-9:
            out.extend([math.inf] * (len(charges) - len(out)))
            break
        out.append(now + scale * (t - now))
        need += charge
        heapq.heappush(heap, (t + lifetime_s, charge))
    return out


class AdmissionLine:
    """Per model, the new sessions waiting to be admitted; the caller prices and places them."""

    def __init__(self, limit: int, hold_s: float = 0.0) -> None:
        self.limit = limit
        self.hold_s = hold_s
        self._scale: dict[str, float] = {}  # model -> EWMA of actual / promised wait: applied to its promises
        self._by_session: dict[str, Waiting] = {}
        self._seq = 0
        self._next_round: dict[tuple[str, str], int] = {}  # (model, tenant) -> its next session's round
        self._served: dict[str, int] = {}  # model -> round of the session admitted last
        self._errors: deque[float] = deque(maxlen=ERRORS_KEPT)  # ready - promised, seconds
        self._taken: dict[str, deque[bool]] = {}  # model -> its recent places' ends: taken (True) or lost
        self.counts: Counter[str] = Counter()  # joined, admitted, returned, expired, full, over_capacity

    # ---- the line ---------------------------------------------------------------------------

    def get(self, session: str | None) -> Waiting | None:
        return None if session is None else self._by_session.get(session)

    def order(self, model: str) -> list[Waiting]:
        """The model's line, first first."""
        return sorted((w for w in self._by_session.values() if w.model == model), key=lambda w: w.key)

    def join(self, session: str, tenant: str, model: str, prompt_tokens: int, max_tokens: int,
             now: float) -> Waiting | None:
        """Put a new session at the back of its model's line (its tenant's back); None when full."""
        if len(self._by_session) >= self.limit:
            self.counts["full"] += 1
            return None
        key = (model, tenant)
        rnd = max(self._next_round.get(key, 0), self._served.get(model, 0))
        self._next_round[key] = rnd + 1
        self._seq += 1
        w = self._by_session[session] = Waiting(session, tenant, model, prompt_tokens, max_tokens, self._seq, rnd,
                                                now, promised_at=now, promised_from=now)
        self.counts["joined"] += 1
        return w

    def may_try(self, entry: Waiting | None, model: str, now: float) -> bool:
        """May this call ask for an instance now, by its place? A newcomer (`entry` None) only while
        nobody waits for its model; a session in line once due or first. (Either may still go in ahead
        into room no promise needs: the dispatcher's `_keeps_promises`.)"""
        if entry is None:
            return not any(w.model == model for w in self._by_session.values())
        return self.due(entry, now) or self.order(model)[0] is entry

    @staticmethod
    def due(entry: Waiting, now: float) -> bool:
        """Its promised time has come (within one control interval)."""
        return entry.promised_at <= now + CONTROL_INTERVAL_S

    def promise(self, entry: Waiting, times: list[float], now: float) -> float:
        """Tell `entry` when to come back: its time in `times` (`promise_times` over its model's line,
        in order), and never before a session ahead of it was told (promises already made are kept:
        a client cannot learn of a change it did not ask about). Returns the promise."""
        line = self.order(entry.model)
        i = line.index(entry)
        t = times[i] if i < len(times) else math.inf
        entry.promised_at = max([t, now] + [w.promised_at for w in line[:i]])
        entry.promised_from = now
        return entry.promised_at

    def scale(self, model: str) -> float:
        """How much longer than promised `model`'s line has been waiting, lately (1: as promised)."""
        return self._scale.get(model, 1.0)

    def returned(self, entry: Waiting) -> None:
        """Its client came back and was not admitted (it is told a new time by `promise`)."""
        entry.returns += 1
        self.counts["returned"] += 1

    def admitted(self, entry: Waiting, now: float) -> None:
        """Its call was placed: it leaves the line."""
        if entry.ready_at is None:
            self.ready(entry, now)
        self._drop(entry)
        self._served[entry.model] = max(self._served.get(entry.model, 0), entry.round)
        self._ended(entry, True)
        self.counts["admitted"] += 1

    def ready(self, entry: Waiting, now: float) -> None:
        """An instance would admit `entry` now: the promise it holds was `now - promised_at` off;
        its model's `scale` learns the ratio of the wait that was to the wait that was promised."""
        entry.ready_at = now
        self._errors.append(now - entry.promised_at)
        promised = entry.promised_at - entry.promised_from
        if promised > CONTROL_INTERVAL_S:  # a promise of "now" says nothing about the rate
            lo, hi = SCALE_BOUNDS
            scale = self.scale(entry.model)
            ratio = min(hi, max(lo, scale * (now - entry.promised_from) / promised))
            self._scale[entry.model] = min(hi, max(lo, (1 - ALPHA) * scale + ALPHA * ratio))

    def expire(self, now: float) -> list[Waiting]:
        """Sessions whose clients did not come back within GRACE_S of their promise lose their place."""
        gone = [w for w in self._by_session.values() if w.promised_at + GRACE_S < now and w.held is None]
        for w in gone:
            self._drop(w)
            self._ended(w, False)
        self.counts["expired"] += len(gone)
        return gone

    def comes_back(self, model: str) -> float:
        """The share of `model`'s recent places in line whose clients came back for them (1 before any
        ended): the chance that a session waiting, whose client has not been back yet, will be."""
        ended = self._taken.get(model)
        return sum(ended) / len(ended) if ended else 1.0

    def expected_charges(self, waiting: list[Waiting], default: float) -> list[float]:
        """What each of `waiting` will hold back the sessions after it by, as likely as it is to be
        admitted at all: in full once its client has been back (or waits at the gateway now), else
        times `comes_back`. A line of clients that never come back (curl, a script without retries)
        then stops reserving room for them as soon as a few places are lost, not GRACE_S after each."""
        return [(w.charge_s or default) * (1.0 if w.returns or w.held is not None else self.comes_back(w.model))
                for w in waiting]

    def heads(self) -> list[Waiting]:
        """The first session of each model's line."""
        first: dict[str, Waiting] = {}
        for w in self._by_session.values():
            if w.model not in first or w.key < first[w.model].key:
                first[w.model] = w
        return list(first.values())

    def drop(self, entry: Waiting) -> None:
        """It leaves the line without being admitted."""
        self._drop(entry)

    def _drop(self, entry: Waiting) -> None:
        self._by_session.pop(entry.session, None)

    def _ended(self, entry: Waiting, taken: bool) -> None:
        self._taken.setdefault(entry.model, deque(maxlen=PLACES_KEPT)).append(taken)

    def __len__(self) -> int:
        return len(self._by_session)

    def __iter__(self):
        return iter(list(self._by_session.values()))

    # ---- what operators see -------------------------------------------------------------------

    def telemetry(self, now: float) -> dict:
        errors = sorted(abs(e) for e in self._errors)
        models: dict[str, list[Waiting]] = {}
        for w in self._by_session.values():
            models.setdefault(w.model, []).append(w)
        return {
            "limit": self.limit, "waiting": len(self._by_session),
            "scale": {m: round(x, 3) for m, x in sorted(self._scale.items())},
            "comes_back": {m: round(self.comes_back(m), 3) for m in sorted(self._taken)},
            "counts": dict(self.counts),
            "promise_error_s": {"samples": len(errors),
                                "p50": errors[len(errors) // 2] if errors else None,
                                "p95": errors[int(0.95 * (len(errors) - 1))] if errors else None,
                                "mean_signed": sum(self._errors) / len(errors) if errors else None},
            "models": {m: [{"session": w.session, "tenant": w.tenant, "waited_s": round(now - w.arrived_at, 3),
                            "due_in_s": round(w.promised_at - now, 3), "returns": w.returns}
                           for w in sorted(ws, key=lambda w: w.key)[:64]] for m, ws in models.items()},
        }
