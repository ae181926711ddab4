"""The load admitted agent sessions will bring: what `overload = "sessions"` admits new sessions against.

A router that admits call by call sees a session only while one of its calls is queued or running.
In its tool gap the session is invisible, yet it is back within seconds with a longer prompt: admit
new sessions into that quiet moment and every returning call finds the instance overloaded. So
every admitted session charges the instance that serves it, from its first placed call until it
goes quiet:

- while a call of it is held at the gateway or runs there: that call's predicted work;
- in a tool gap: its next call's predicted work, priced from its last call (that call's prompt and
  reply, grown by what its previous turn added, else by the model's mean growth; its prefix kept, as
  far as the model's cache resumes from it (`PlacementCosts.work_s`: a recurrent state only at its
  snapshot), unless the prefixes of the sessions admitted there outgrow the KV pool: then a full
  prefill); after its first call, times the chance that it makes a second (`SessionLengths.
  second_call`, the share of the model's ended sessions that did). A session that has called twice
  is an agent loop and is charged in full until it goes quiet; a first call alone tells nothing, and
  a node serving one-call clients (scripts, SDKs without a session id: no tool gap is ever seen, so
  each stays charged for QUIET_FIRST_S) learns from them ending to reserve nothing for them;
- once quiet (no call for longer than this model's tool gaps suggest, `GapEstimate`; at most
  `session_ttl_s`): nothing. It is still an admitted session (talaria/routing/shedding.py); its next
  call charges again from its arrival.

What a new session is admitted against (`InstanceLoad.ahead_s`): an instance batching continuously
serves its running sequences together, one step at a time, much as a processor-sharing server
does; under processor sharing a job needing `x` seconds of work is held back by each other job by
at most `x` (by its own work when that is less). The new session's first call needs its prefill
before its first token, so its predicted start is that prefill plus, over every admitted session,
the lesser of that session's predicted call and that prefill. A long decode in flight then delays
it by a step's worth, not by its whole length; forty sessions in tool gaps delay it forty times.
Not only its first call counts (`InstanceLoad.admit_x`): an agent's first call is short (its task),
its later ones carry tool results, and each admitted session's next call waits behind the newcomer
as the newcomer waits behind them. So the prefill it is admitted against is the longer of its own and
the model's typical next call there (an EWMA of the admitted sessions' priced next prefills): a burst
of short first calls cannot fill an instance whose sessions' next calls would then miss the target.

Where the predictions were wrong (`InstanceLoad.scale`): each new session's first call was predicted
to start after its queue and prefill; the first token it measured against that corrects every later
admission there, as an EWMA of measured over predicted with the cost model's gain (`observe_start`).
A machine slower under this load than its profile says (other processes, the gateway's own work)
then admits fewer sessions; one that is faster no more than the processor-sharing bound allows (the
scale is at least 1: SCALE_BOUNDS).

When admitted sessions leave (`departures`): for the admission line's promises
(talaria/routing/admission_line.py), each session's expected end, from the calls it has made and the
session lengths and turn times the router has seen of its model (`SessionLengths`, one per model:
a model's agents, its speed and its rounds make its own turns, and a cold model waiting for its slot
must not stretch a hot one's promises): its expected further calls, a turn each, then `quiet_s`.

Seconds come from the router's cost model through an injected `price` (PlacementCosts.work_s).
Each instance's sessions sit in one `InstanceLoad` the router's view holds (talaria/routing/
instance_view.py); quiet sessions leave through a heap, lazily. Only ints, floats and hashes: no
I/O, the clock is the caller's.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from talaria.routing.session_lengths import ALPHA, SessionLengths

# price(instance, model, prompt_tokens, reusable_tokens, max_tokens, footprint_tokens) -> seconds or None
Price = Callable[[str, str, int, int, int, int], "float | None"]

QUIET_FIRST_S = 10.0  # before any gap is seen: the replay caps recorded tool gaps at 10 s (DESIGN.md)
QUIET_MIN_S = 2.0  # never quiet sooner: the paper's tool gaps are 0.39 s p50, 1.32 s p95 (§2.1)
GROWTH_ALPHA = ALPHA  # weight of the newest turn in a model's mean prompt growth (as the instances' cost EWMA)
SCALE_BOUNDS = (1.0, 4.0)  # measured / predicted start: a few wild calls must not shut admission, and none
# opens it past the processor-sharing bound: that bound holds when the admitted sessions' next calls come
# together, which is when their tails miss the target; first calls starting sooner on average say nothing
# of that (patient workload at 4939167: the scale at 0.5 for a minute, five sessions in service, their
# later calls' TTFT p95 3.9-4.5 s)


class GapEstimate:
    """A model's tool gaps (a call's completion to the session's next call), estimated as TCP
    estimates round trips (RFC 6298: SRTT and RTTVAR with gains 1/8 and 1/4): a session whose gap
    has run past `srtt + 4 * rttvar` has most likely finished, or is running a long tool."""

    __slots__ = ("rttvar", "srtt")

    def __init__(self) -> None:
        self.srtt: float | None = None
        self.rttvar = 0.0

    def sample(self, gap_s: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = gap_s, gap_s / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - gap_s)
            self.srtt = 0.875 * self.srtt + 0.125 * gap_s

    @property
    def bound_s(self) -> float | None:
        """`srtt + 4 * rttvar` (RFC 6298's RTO before its clamps): a gap longer than this is unusual;
        None before the first gap."""
        return None if self.srtt is None else self.srtt + 4 * self.rttvar

    @property
    def quiet_s(self) -> float:
        """How long after a completion a session without a call counts as quiet."""
        bound = self.bound_s
        return QUIET_FIRST_S if bound is None else max(QUIET_MIN_S, bound)


class InstanceLoad:
    """The admitted sessions charging one instance: each one's predicted call, and their prefixes."""

    __slots__ = ("kv", "nxt", "samples", "scale", "work")

    def __init__(self) -> None:
        self.work: dict[tuple[str, str], float] = {}  # (session, model) -> seconds
        self.kv: dict[str, int] = {}  # model -> KV tokens of their prefixes
        self.nxt: dict[str, float] = {}  # model -> EWMA of the prefill of their next calls, seconds
        self.scale = 1.0  # EWMA of measured / predicted start of new sessions' first calls here
        self.samples = 0  # how many it has seen

    def ahead_s(self, prefill_s: float) -> float:
        """How long these sessions' calls hold back a call needing `prefill_s` before its first token:
        each by the lesser of its own work and that (processor sharing), times `scale`. O(sessions here)."""
        return self.scale * sum(min(prefill_s, w) for w in self.work.values())

    def admit_x(self, model: str, prefill_s: float) -> float:
        """The prefill a new session of `model` whose first call needs `prefill_s` is admitted against:
        that, or the model's typical next call here if longer."""
        return max(prefill_s, self.nxt.get(model, 0.0))

    def observe_next(self, model: str, prefill_s: float) -> None:
        """A session here will come back with a call needing `prefill_s` before its first token."""
        mean = self.nxt.get(model)
        self.nxt[model] = prefill_s if mean is None else (1 - ALPHA) * mean + ALPHA * prefill_s

    def observe_start(self, predicted_s: float, measured_s: float) -> None:
        """A new session's first call was predicted to start (its first token) `predicted_s` after it
        arrived and did at `measured_s`."""
        if predicted_s <= 0:
            return
        lo, hi = SCALE_BOUNDS
        ratio = min(hi, max(lo, self.scale * measured_s / predicted_s))  # the prediction had scale in it
        self.scale = min(hi, max(lo, (1 - ALPHA) * self.scale + ALPHA * ratio))
        self.samples += 1

    @property
    def total_s(self) -> float:
        """All of their predicted work."""
        return sum(self.work.values())


@dataclass(slots=True)
class _Session:
    session: str
    instance: str  # whose load it is part of
    model: str
    work_s: float  # what it charges there now
    kv_tokens: int  # its prefix on that instance (its last call's prompt and reply)
    busy: bool  # a call of it is held or running: it cannot go quiet
    done_at: float  # its last call's end
    quiet_at: float  # done_at + the model's quiet_s then
    end_tokens: int = 0  # prompt + reply of its last call: where its next prompt starts
    calls: int = 1  # calls it has made (the one held or running included)
    last_arrival: float = 0.0  # its latest call's arrival
    growth: int | None = None  # tokens its last turn added to that (the tool result and the template)
    max_tokens: int = 0  # its last call's


class SessionLoad:
    """Per instance (`on`), the calls the admitted sessions placed there will bring and their
    prefixes. The gateway tells it of each call: `arrived`, `placed`, `completed` or `failed`."""

    def __init__(self, price: Price, ttl_s: float) -> None:
        self.price = price
        self.ttl_s = ttl_s
        self._sessions: dict[tuple[str, str], _Session] = {}
        self._on: dict[str, InstanceLoad] = {}
        self._quiet: list[tuple[float, str, str]] = []  # (quiet_at, session, model), stale entries skipped
        self._gaps: dict[str, GapEstimate] = {}
        self._growth: dict[str, float] = {}  # model -> mean tokens a turn adds
        self._lengths: dict[str, SessionLengths] = {}  # model -> how many calls its sessions make, a turn's time

    # ---- what the gateway reports ---------------------------------------------------------------

    def arrived(self, session: str, model: str, prompt_tokens: int, now: float) -> None:
        """A call of an admitted session arrived: its gap and its turn's growth are measured, and it
        cannot go quiet until the call ends. A quiet session charges again once placed."""
        s = self._sessions.get((session, model))
        if s is None or s.busy:
            return
        self._gaps.setdefault(model, GapEstimate()).sample(max(0.0, now - s.done_at))
        self.lengths(model).turn(now - s.last_arrival)
        s.calls, s.last_arrival = s.calls + 1, now
        if s.end_tokens and prompt_tokens >= s.end_tokens:
            s.growth = prompt_tokens - s.end_tokens
            mean = self._growth.get(model)
            self._growth[model] = s.growth if mean is None else (1 - GROWTH_ALPHA) * mean + GROWTH_ALPHA * s.growth
        s.busy = True

    def placed(self, session: str, model: str, instance: str, work_s: float, kv_tokens: int, now: float) -> None:
        """A call of `session` was placed on `instance`, predicted to take `work_s` there; `kv_tokens`:
        the prefix it will leave."""
        s = self._sessions.get((session, model))
        if s is None:
            s = self._sessions[(session, model)] = _Session(session, instance, model, 0.0, 0, True, now, now,
                                                            last_arrival=now)
        self._charge(s, instance, work_s, kv_tokens)
        s.busy = True

    def completed(self, session: str, model: str, instance: str, prompt_tokens: int, reply_tokens: int,
                  max_tokens: int, now: float) -> None:
        """Its call ended normally: from now it charges its next call, until it goes quiet."""
        s = self._sessions.get((session, model))
        if s is None:
            return
        end = prompt_tokens + reply_tokens
        s.end_tokens, s.max_tokens = end, max_tokens
        growth = s.growth if s.growth is not None else int(self._growth.get(model, 0.0))
        kv = self.on(instance).kv
        footprint = kv.get(model, 0) - (s.kv_tokens if s.instance == instance else 0) + end + growth
        if s.growth is not None:  # a next call priced from this session's own turn, not the model's mean
            prefill = self.price(instance, model, end + growth, max(0, end - 1), 0, footprint)
            if prefill is not None:
                self.on(instance).observe_next(model, prefill)
        work = self.price(instance, model, end + growth, max(0, end - 1), max_tokens, footprint)
        returns = self.lengths(model).second_call() if s.calls == 1 else 1.0
        self._charge(s, instance, returns * (s.work_s if work is None else work), end)
        self._rest(s, now)

    def failed(self, session: str, model: str, now: float) -> None:
        """Its call ended abnormally (an error, its client gone): it keeps what it charged, a retry
        being as likely as not, until it goes quiet."""
        s = self._sessions.get((session, model))
        if s is not None:
            self._rest(s, now)

    # ---- what admission reads -------------------------------------------------------------------

    def sweep(self, now: float) -> None:
        """Sessions quiet by now stop charging."""
        heap = self._quiet
        while heap and heap[0][0] <= now:
            quiet_at, session, model = heapq.heappop(heap)
            s = self._sessions.get((session, model))
            if s is not None and not s.busy and s.quiet_at == quiet_at:
                self._charge(s, None, 0.0, 0)
                del self._sessions[(session, model)]
                self.lengths(model).ended(s.calls)

    def on(self, instance: str) -> InstanceLoad:
        """The sessions charging `instance` (the same object for as long as this lives)."""
        load = self._on.get(instance)
        if load is None:
            load = self._on[instance] = InstanceLoad()
        return load

    def departures(self, instance: str, prefill_s: float, now: float) -> list[tuple[float, float]]:
        """(when, how much less it holds back a call needing `prefill_s`), for every session charging
        `instance`, soonest first: when each is expected to go quiet, from its calls so far and the
        session lengths seen (a turn a further call, then its model's quiet_s)."""
        out = []
        scale = self.on(instance).scale
        for s in self._sessions.values():
            if s.instance != instance:
                continue
            lengths = self.lengths(s.model)
            turn = lengths.turn_s if lengths.turn_s is not None else s.work_s + QUIET_MIN_S
            more = lengths.remaining_calls(s.calls) * turn
            # resting: quiet when its last call would have left it quiet, that many turns later; busy: after
            # its call's predicted work, the turns, and its model's quiet_s
            end = s.quiet_at + more if not s.busy else now + s.work_s + more + self.quiet_s(s.model)
            out.append((max(now, end), scale * min(prefill_s, s.work_s)))
        out.sort()
        return out

    def lifetime_s(self, work_s: float, model: str) -> float:
        """A session admitted now is expected to charge its instance this long: its calls, a turn
        each (its first `work_s`), then its model's quiet_s."""
        lengths = self.lengths(model)
        turn = lengths.turn_s if lengths.turn_s is not None else work_s + QUIET_MIN_S
        return work_s + lengths.remaining_calls(1) * turn + self.quiet_s(model)

    def lengths(self, model: str) -> SessionLengths:
        """How long `model`'s sessions last, in calls and turns (the same object for as long as this lives)."""
        lengths = self._lengths.get(model)
        if lengths is None:
            lengths = self._lengths[model] = SessionLengths()
        return lengths

    def telemetry(self) -> dict:
        """Per model, what the line predicts its admitted sessions' remaining work from."""
        return {model: lengths.telemetry() for model, lengths in sorted(self._lengths.items())}

    def quiet_s(self, model: str) -> float:
        gaps = self._gaps.get(model)
        return min(self.ttl_s, QUIET_FIRST_S if gaps is None else gaps.quiet_s)

    def __len__(self) -> int:
        """Sessions charging some instance (quiet ones not yet swept included)."""
        return len(self._sessions)

    # ---- bookkeeping ----------------------------------------------------------------------------

    def _charge(self, s: _Session, instance: str | None, work_s: float, kv_tokens: int) -> None:
        """Move `s`'s charge to `instance` (None: nowhere)."""
        # invariant: on(i).work holds exactly the sessions whose instance is i, and on(i).kv[m] the sum of
        # their kv_tokens per model
        key, old = (s.session, s.model), self.on(s.instance)
        old.work.pop(key, None)
        old.kv[s.model] = old.kv.get(s.model, 0) - s.kv_tokens
        s.work_s, s.kv_tokens = work_s, kv_tokens
        if instance is None:
            return
        s.instance, new = instance, self.on(instance)
        new.work[key] = work_s
        new.kv[s.model] = new.kv.get(s.model, 0) + kv_tokens

    def _rest(self, s: _Session, now: float) -> None:
        s.busy, s.done_at = False, now
        s.quiet_at = now + self.quiet_s(s.model)
        heapq.heappush(self._quiet, (s.quiet_at, s.session, s.model))
        if len(self._quiet) > 2 * len(self._sessions) + 1024:  # every rest leaves a stale entry: compact
            self._quiet = [(x.quiet_at, x.session, x.model) for x in self._sessions.values() if not x.busy]
            heapq.heapify(self._quiet)
