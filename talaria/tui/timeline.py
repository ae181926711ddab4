"""One cold instance's rounds, rebuilt from the event log for the rounds panel.

The event log reports a segment when it ends (docs/events.md): a `slot_phase` record carries its
`start`, a `switch` record its `total_ms` and end time, a `round` record closes its round. So the
timeline is kept as a list of timed segments and a round is a time window over them: a closed
round's window comes from its record; the open round's from its first phase (and the switch right
before it, since a round opens before its first switch). Telemetry adds what the log cannot say yet:
the round budget, and the phase the open slot is in right now.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from talaria.contracts.telemetry import RoundState

SWITCH = "switch"
GLYPHS = {"P": "P", "D1": "D", "D": "D", "Dfin": "D", "SP": "S", SWITCH: "~"}
IDLE, AHEAD = "·", "░"  # elapsed with no step reported; budget the round has not used (yet)
SWITCH_GAP_S = 0.05  # a switch that ends this close before a round's first phase opened that round
KEEP_SEGMENTS = 512
KEEP_ROUNDS = 16
KEEP_ADMITS = 32


@dataclass(frozen=True, slots=True)
class Segment:
    """A stretch of one slot's time: a phase segment (P, D1, SP, D, Dfin) or a model switch."""

    kind: str  # a slot phase, or SWITCH
    model: str  # the slot's model; for a switch, the model switched to
    start: float  # node clock, s
    end: float
    round: int | None  # None for a switch: its record carries no round number


@dataclass(frozen=True, slots=True)
class ClosedRound:
    """A `round` record: the round's window and where its time went."""

    number: int
    start: float
    wall_s: float
    switch_s: float
    p_s: float
    d_s: float
    sp_s: float
    sp_admitted: int
    sp_parked: int
    slots: tuple[dict, ...]  # {model, budget_s, used_s, protected, decode_steps, sp_opportunities}

    @classmethod
    def from_record(cls, r: dict[str, Any]) -> ClosedRound:
        return cls(r["round"], r["start"], r["wall_s"], r.get("switch_s", 0.0), r.get("p_s", 0.0),
                   r.get("d_s", 0.0), r.get("sp_s", 0.0), r.get("sp_admitted", 0), r.get("sp_parked", 0),
                   tuple(r.get("slots", ())))

    @property
    def end(self) -> float:
        return self.start + self.wall_s

    @property
    def slot_budget_s(self) -> float:
        return sum(s.get("budget_s", 0.0) for s in self.slots)


@dataclass(frozen=True, slots=True)
class RoundView:
    """One round as the rounds panel draws it."""

    number: int
    start: float
    end: float  # closed: start + wall_s; open: now
    budget_s: float | None  # the round bound (gamma * ttft_s) when known
    closed: ClosedRound | None  # None while the round is open
    segments: tuple[Segment, ...]  # in start order; the open slot's current phase last, up to `end`
    admits: tuple[dict, ...]  # the round's `sp_admit` records
    slot: dict | None = None  # the open slot from telemetry (RoundState.slot), when newer than the events

    @property
    def span_s(self) -> float:
        """Seconds the bar covers: the budget, or longer when the round overran it."""
        return max(self.budget_s or 0.0, self.end - self.start)


class RoundTimeline:
    """Recent segments, round records and SP admissions of one cold instance."""

    def __init__(self) -> None:
        self._segments: deque[Segment] = deque(maxlen=KEEP_SEGMENTS)
        self._closed: OrderedDict[int, ClosedRound] = OrderedDict()
        self._admits: deque[dict] = deque(maxlen=KEEP_ADMITS)
        self.state: RoundState | None = None  # the latest telemetry
        self._state_t = 0.0  # when that snapshot was taken

    def add_phase(self, e: dict[str, Any]) -> None:
        last = self.last_closed
        if last is not None and e["round"] <= last.number and e["start"] >= last.end:
            # round numbers only grow, so an old number after the last round is a restarted
            # instance counting from 1 again: its earlier rounds would shadow the new ones
            self._closed.clear()
            self._segments = deque((s for s in self._segments if s.start >= last.end), maxlen=KEEP_SEGMENTS)
        self._segments.append(Segment(e["phase"], e["model"], e["start"], e["start"] + e["duration_s"],
                                      e["round"]))

    def add_switch(self, e: dict[str, Any]) -> None:
        t = e["t"]
        self._segments.append(Segment(SWITCH, e["to_model"], t - e["total_ms"] / 1000.0, t, None))

    def add_admit(self, e: dict[str, Any]) -> None:
        self._admits.append(e)

    def add_round(self, record: dict[str, Any]) -> None:
        self._closed[record["round"]] = ClosedRound.from_record(record)
        while len(self._closed) > KEEP_ROUNDS:
            self._closed.popitem(last=False)

    def observe(self, state: RoundState, t: float) -> None:
        """A telemetry snapshot taken at node time `t`; its round summaries fill rounds whose
        records this dashboard never saw (it connected after the event buffer dropped them)."""
        self.state, self._state_t = state, t
        for r in state.last_rounds:
            if r["round"] not in self._closed and r["round"] > max(self._closed, default=0):
                self.add_round(r)

    def view(self, now: float | None) -> RoundView | None:
        """The open round if there is one, else the last closed round; None before any round."""
        opened = self._open_view(now, self.budget_s)
        if opened is not None:
            return opened
        if not self._closed:
            return None
        last = next(reversed(self._closed.values()))
        return RoundView(last.number, last.start, last.end, self.budget_s, last,
                         self._between(last.start, last.end, last.number), self._admits_of(last.number))

    @property
    def budget_s(self) -> float | None:
        """The round bound gamma * ttft_s from telemetry; without it (a replay), the largest total
        of slot budgets among the rounds seen, which the bound caps."""
        if self.state is not None and self.state.round_s > 0:
            return self.state.round_s
        return max((r.slot_budget_s for r in self._closed.values()), default=0.0) or None

    @property
    def last_closed(self) -> ClosedRound | None:
        return next(reversed(self._closed.values()), None)

    def _open_number(self) -> int | None:
        done = max(self._closed, default=0)
        numbers = {s.round for s in self._segments if s.round is not None and s.round > done}
        if self.state is not None and self.state.round is not None and self.state.round > done:
            numbers.add(self.state.round)
        return max(numbers, default=None)

    def _open_view(self, now: float | None, budget: float | None) -> RoundView | None:
        number = self._open_number()
        if number is None:
            return None
        phases = [s for s in self._segments if s.round == number]
        if not phases:  # telemetry says it is open, but none of its phases has been reported
            return None
        start = min(s.start for s in phases)
        before = max((s for s in self._segments if s.kind == SWITCH and s.end <= start + 1e-9),
                     key=lambda s: s.end, default=None)
        if before is not None and start - before.end <= SWITCH_GAP_S:
            start = before.start
        segments = self._between(start, float("inf"), number)
        reported = max(s.end for s in segments)
        end = max(reported, now) if now is not None else reported
        slot = self._fresh_slot(number, reported)
        if slot is not None and end > reported:  # the phase the slot is in since its last record
            segments.append(Segment(slot["phase"], slot["model"], reported, end, number))
        return RoundView(number, start, end, budget, None, tuple(segments), self._admits_of(number), slot)

    def _fresh_slot(self, number: int, reported: float) -> dict | None:
        """The snapshot's open slot, if the snapshot is of this round and newer than its last record;
        an older one (snapshots lag by up to 0.5 s) would name a slot that has already closed."""
        s = self.state
        if s is None or s.round != number or self._state_t <= reported:
            return None
        return s.slot

    def _between(self, start: float, end: float, number: int) -> list[Segment]:
        """The round's phases, and the switches inside its window."""
        eps = 1e-6
        picked = [s for s in self._segments
                  if s.round == number or (s.kind == SWITCH and s.start >= start - eps and s.end <= end + eps)]
        return sorted(picked, key=lambda s: s.start)

    def _admits_of(self, number: int) -> tuple[dict, ...]:
        return tuple(a for a in self._admits if a.get("round") == number)


def paint(view: RoundView, width: int) -> str:
    """The round as `width` glyphs, one column per span/width seconds: P prefill, D decode,
    S session-prefill, ~ switch, · elapsed between steps, ░ budget not used (yet).

    Segments are laid left to right in start order and each gets at least one column, so a 1 ms
    switch before a 10 ms prefill shows as "~P" instead of vanishing; a segment pushed right by
    such a neighbour still ends where its time says, so the drift never accumulates.
    """
    if width <= 0:
        return ""
    span = view.span_s
    if span <= 0:
        return AHEAD * width
    scale = span / width
    elapsed_cols = min(width, round((view.end - view.start) / scale))
    cells = [IDLE] * elapsed_cols + [AHEAD] * (width - elapsed_cols)
    cursor = 0
    for seg in view.segments:  # in start order
        first = max(cursor, int((seg.start - view.start) / scale))
        if first >= width:
            break
        last = min(width, max(first + 1, round((seg.end - view.start) / scale)))
        cells[first:last] = GLYPHS.get(seg.kind, "?") * (last - first)
        cursor = last
    return "".join(cells)
