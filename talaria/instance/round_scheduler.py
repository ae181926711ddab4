"""The cold-pool round scheduler with session-prefill (paper §3.4, Eq. (3)-(5), Fig. 4).

Time on a cold instance is organised in rounds. A round gives each model with work one slot, in
the order the slot-order policy picks, and models switch only at slot boundaries. A slot runs

    P -> D1 -> (SP -> D)* -> Dfin

P prefills the work that was queued when the slot opened; D steps decode every running sequence of
the model; at each decode boundary an SP step may prefill a bounded batch of *continuations* that
arrived after P (a session served here before, whose prefix is device-resident or restorable from
the host KV registry), when the model's prefill fixed cost fits one decode step's TPOT slack (an SP
step stalls every decoder for its whole time). New sessions never bypass P. Dfin is the decode
after the post-protected budget is spent.

Budgets come from predicted costs (a CostModel over a profile) and the injected clock:
- the round is bounded by R <= gamma * ttft_s (Eq. (5)); the slot-length policy splits what the
  predicted switches leave;
- decode share (Eq. (4)): d_m (T_tpot - t_D) >= U_m with U_m = R - d_m t_D reduces to
  d_m >= R / T_tpot decode iterations per round, reserved before P and SP get budget;
- P and SP get only what is left after the protected decode; each chunk is sized to fit, so a long
  prompt advances chunk by chunk across opportunities. A call whose restore plus smallest chunk
  does not fit waits (it is parked, and an event says so).
Shortfalls are counted in `deadline_risk` and reported, never hidden by rolling work forward.

Slots worth less than their opening (switch and P's fixed cost) are deferred (slot_policy.ThrashGuard).
Each step is of one phase; the scheduler times phases and rounds, emits `slot_phase`, `sp_admit`,
`sp_park` and `round` events, and sees time only through the clock and costs only through the model.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable
from itertools import count

from talaria.contracts.events import EventKind
from talaria.contracts.step_plan import SeqChunk
from talaria.contracts.vocabulary import SwitchPath
from talaria.instance.batcher import Batcher
from talaria.instance.cost_model import CostModel
from talaria.instance.prompt_costs import PromptCosts
from talaria.instance.rounds import (
    DECODE_PHASES,
    Phase,
    Round,
    RoundConfig,
    Slot,
    Step,
    Switch,
)
from talaria.instance.sequence import SeqStatus, Sequence
from talaria.instance.slot_policy import SLOT_LENGTHS, SLOT_ORDERS, ThrashGuard
from talaria.instance.sp_batch import SP_BATCHES, SpOpportunity, within_tpot_slack

ROUNDS_KEPT = 8  # round summaries kept for telemetry


class RoundScheduler:
    def __init__(self, batchers: dict[str, Batcher], costs: CostModel, clock: Callable[[], float],
                 config: RoundConfig, emit: Callable[..., None], switch_coverage: Callable[[str], float],
                 known_session: Callable[[str], bool], page_size: int) -> None:
        self.batchers = batchers
        self.costs = costs
        self.clock = clock
        self.config = config
        self._emit = emit  # emit(kind, **data)
        self._coverage = switch_coverage  # how much of this model's weights staging covers now
        self._known = known_session  # a session this instance has served (continuations only)
        self.page_size = page_size
        # the smallest prefill chunk worth a step: a forward's fixed cost makes tiny chunks waste the slot
        self.min_chunk = config.min_chunk_tokens or max(page_size, config.max_batch_tokens // 4)
        self.prompts = PromptCosts(costs, page_size, self.min_chunk)
        self._order = list(batchers)
        self._numbers = count(1)
        self.round: Round | None = None
        self.slot: Slot | None = None
        self._pending: tuple[str, Phase | None, float, float] | None = None  # (model, phase, predicted, t0)
        self._last_path = SwitchPath.H2D_ONLY  # of the switch in flight
        self.deadline_risk: Counter = Counter()
        self._guard = ThrashGuard(config.thrash_k, config.max_deferrals)
        self.summaries: deque[dict] = deque(maxlen=ROUNDS_KEPT)
        self.sp_admitted = 0
        self.sp_parked = 0

    # ---- the public verb ---------------------------------------------------------------------

    def next(self, active: str | None) -> Step | Switch | None:
        """What the instance runs next: a switch, a step of the active model, or None (idle)."""
        now = self.clock()
        for _ in range(2 * len(self._order) + 2):  # slots may close and open within one call
            if self.slot is None and not self._open_slot(now, active):
                return None
            decision = self._in_slot(self.slot, now, active)
            if decision is not None:
                return decision
            self._close_slot(now)
        return None

    def committed(self, step_s: float | None = None) -> None:
        """The step or switch `next` returned has run; charge its time to the round."""
        if self._pending is None:
            return
        model, phase, predicted, t0 = self._pending
        self._pending = None
        took = self.clock() - t0
        if phase is None:
            self.round.time["switch"] += took
            self.costs.observe(model, f"switch:{self._last_path.value}", predicted, took)
            return
        self.round.time["SP" if phase is Phase.SP else "P" if phase is Phase.P else "D"] += took
        self.costs.observe(model, "decode" if phase in DECODE_PHASES else "prefill", predicted, took)

    def close(self) -> None:
        """Close the open slot and round now: on a forced switch, and when nothing is left to run."""
        now = self.clock()
        if self.slot is not None:
            self._close_slot(now, keep_round=False)
        elif self.round is not None:
            self._close_round(now)

    @property
    def in_flight(self) -> tuple[str, float] | None:
        """(phase or "switch", predicted seconds) of what `next` returned and has not been committed."""
        if self._pending is None:
            return None
        _, phase, predicted, _ = self._pending
        return ("switch" if phase is None else phase.value), predicted

    # ---- rounds and slots --------------------------------------------------------------------

    def _open_slot(self, now: float, active: str | None) -> bool:
        if self.round is None:
            self._open_round(now, active)
            if self.round is None:
                return False
        while self.round.queue:
            model = self.round.queue.pop(0)
            if self.batchers[model].has_work:  # work can vanish (cancelled) before its slot comes
                self.slot = Slot(model, self.round.budgets[model], self.round.protected[model])
                return True
        self._close_round(now)
        return self._open_slot(now, active) if any(b.has_work for b in self.batchers.values()) else False

    def _open_round(self, now: float, active: str | None) -> None:
        with_work = [m for m in self._order if self.batchers[m].has_work]
        if not with_work:
            return
        cfg = self.config
        protected, demand, fixed = {}, {}, {}
        for m in with_work:
            t_d = self._decode_step_s(m)
            if cfg.tpot_s <= t_d:
                self.deadline_risk["tpot_infeasible"] += 1  # Eq. (4) cannot hold for this profile
            protected[m] = math.ceil(cfg.round_s / cfg.tpot_s)
            b = self.batchers[m]  # its P, then its calls' decode: the longest output expected of them
            fixed[m], p_s = self.prompts.p_phase(m, b, cfg.max_batch_tokens)
            demand[m] = max(protected[m], b.outputs.longest(len(b.running) + len(b.waiting))) * t_d + p_s
        queue = SLOT_ORDERS[cfg.order](with_work, self._order, active, demand)
        queue, switches, budgets, deferred = self._guard.slots(
            queue, demand, lambda q: self._switches(q, active), SLOT_LENGTHS[cfg.length], cfg.round_s, fixed)
        if sum(switches.values()) >= cfg.round_s:
            self.deadline_risk["round_infeasible"] += 1  # switches alone exceed gamma * ttft_s
        for m in queue:
            if protected[m] * self._decode_step_s(m) > budgets[m] and self.batchers[m].running:
                self.deadline_risk["decode_share"] += 1  # the reserved decode does not fit the slot
        self.deadline_risk["thrash_deferred"] += len(deferred)
        self.round = Round(next(self._numbers), now, queue, budgets, protected, deferred)

    def _switches(self, queue: list[str], active: str | None) -> dict[str, float]:
        """The predicted switch into each slot of `queue` (0 for the active model's own slot first)."""
        switches, prev = {}, active
        for m in queue:
            switches[m] = 0.0 if m == prev else self.costs.switch_s(m, self._coverage(m) if prev == active else 0.0)
            prev = m
        return switches

    def _close_round(self, now: float) -> None:
        r, self.round = self.round, None
        if not r.slots and not r.time["switch"]:
            self._numbers = count(r.number)  # nothing ran (work blocked on KV): no round to report
            return
        summary = r.summary(now)
        if summary["wall_s"] > self.config.round_s * (1 + 1e-9):
            self.deadline_risk["round_over"] += 1
        self.summaries.append(summary)
        self._emit(EventKind.ROUND, **summary)

    def _close_slot(self, now: float, keep_round: bool = True) -> None:
        s, self.slot = self.slot, None
        if s.start is not None and s.steps:
            self._end_segment(s, now)
            b = self.batchers[s.model]
            for seq in b.waiting:  # continuations that came back during the slot and never fitted
                if seq.seq_id not in s.parked and self._eligible(s, b, seq):
                    self._park(s, seq, "slot-closed" if self.config.sp else "sp-off")
            self.round.slots.append({"model": s.model, "budget_s": s.budget_s, "used_s": now - s.start,
                                     "protected": s.protected, "decode_steps": s.decode_steps,
                                     "sp_opportunities": s.opportunities})
        if not keep_round or not self.round.queue:
            self._close_round(now)

    # ---- inside a slot -----------------------------------------------------------------------

    def _in_slot(self, s: Slot, now: float, active: str | None) -> Step | Switch | None:
        b = self.batchers[s.model]
        if s.model != active:
            coverage = self._coverage(s.model)
            self._last_path = path = SwitchPath.for_coverage(coverage)
            predicted = self.costs.switch_s(s.model, coverage)
            self._pending = (s.model, None, predicted, now)
            return Switch(s.model, path, predicted)
        if s.start is None:  # P begins: what is queued now, and prompts left half-done, are P's
            s.start = s.seg_start = now
            s.p_set = {seq.seq_id for seq in b.waiting} | {seq.seq_id for seq in b.running if seq.is_prefilling}
        owed = s.decode_steps < s.protected and bool(b.decoding)  # Eq. (4): reserved decode comes first
        # Closing the slot preempts every running sequence; what the host KV registry cannot keep
        # (none, full, or evicted before it comes back) is recomputed. A prompt that lost KV once
        # finishes its prefill in its next slot, budget or not, which yields a token: else a call
        # longer than a slot could restart at every slot forever. All else keeps the slot's budget.
        stranded = any(self._must_finish(q) for q in b.running)
        if s.steps and now - s.start >= s.budget_s and not owed and not stranded:
            return None
        if s.phase is Phase.P:
            step = self._prefill(s, b, now, Phase.P)
            if step is not None:
                return step
            if not s.short and any(seq.seq_id in s.p_set for seq in b.waiting):
                s.short = True
                self.deadline_risk["prefill_shortfall"] += 1  # queued work left for the next slot
        if self.config.sp and (s.last in DECODE_PHASES or not b.decoding):  # a decode boundary
            step = self._prefill(s, b, now, Phase.SP)
            if step is not None:
                return step
        elif not self.config.sp:
            for seq in b.waiting:
                if seq.seq_id not in s.parked and self._eligible(s, b, seq):
                    self._park(s, seq, "sp-off")
        decoders = b.decoding
        if not decoders:
            return None
        predicted = self.costs.decode_s(s.model, len(decoders), sum(len(q.token_ids) for q in decoders))
        if s.steps and now - s.start + predicted > s.budget_s and not owed and not stranded:
            return None  # the next decode would overrun the slot: the round bound wins over the rest
        final = self._left(s, b, now) < self.costs.prefill_s(s.model, self.min_chunk)  # no prefill fits any more
        phase = Phase.DFIN if final else Phase.D if s.opportunities else Phase.D1
        chunks = b.decode_chunks(self.config.max_batch_tokens)
        if not chunks:
            return None
        if len(chunks) != len(decoders):  # KV pressure or the step budget cut the batch: price what runs
            predicted = self.costs.decode_s(s.model, len(chunks), sum(c.context_len for c in chunks))
        s.decode_steps += 1
        return self._step(s, now, phase, chunks, predicted)

    def _left(self, s: Slot, b: Batcher, now: float) -> float:
        """Budget left for P and SP once the remaining protected decode is set aside."""
        decoders = b.decoding
        will_decode = decoders or any(seq.seq_id in s.p_set for seq in b.running + list(b.waiting))
        remaining = max(0, s.protected - s.decode_steps)
        reserve = remaining * self._decode_step_s(s.model, max(1, len(decoders))) if will_decode else 0.0
        return s.budget_s - (now - s.start) - reserve

    def _prefill(self, s: Slot, b: Batcher, now: float, phase: Phase) -> Step | None:
        """The P step, or the SP batch at this opportunity: chunks that fit the budget left."""
        mine = s.p_set if phase is Phase.P else s.sp_set
        started = [q for q in b.running if q.seq_id in mine and q.is_prefilling]
        if phase is Phase.P:
            queued = [q for q in b.waiting if q.seq_id in s.p_set]
        else:
            queued = [q for q in b.waiting if self._eligible(s, b, q)]
            if queued and not within_tpot_slack(self.costs.prefill_fixed_s(s.model), self._sp_decode_s(s.model, b),
                                                self.config.tpot_s):
                for q in queued:
                    self._park(s, q, "tpot")
                queued = []
            if queued:  # the configured SP batch rule (sp_batch.py) picks which, and in what order
                queued = SP_BATCHES[self.config.sp_batch](queued, lambda q: self.prompts.work(s.model, b, q),
                                                          lambda: self._opportunity(s, b, now, bool(started)))
        if not started and not queued:
            return None  # the common case at a decode boundary: nothing to prefill, no budget to work out
        left, tokens = self._left(s, b, now), self.config.max_batch_tokens
        chunks: list[SeqChunk] = []
        joined: list[Sequence] = []  # admitted by SP at this opportunity
        cost = 0.0
        for seq in started + queued:
            if tokens <= 0:
                break
            admitted = seq.status is SeqStatus.RUNNING
            # a started prompt that lost KV before finishes here, budget or not (see _in_slot)
            budget = math.inf if admitted and self._must_finish(seq) else left - cost
            n, c = self.prompts.fit(s.model, b, seq, budget, tokens, batched=bool(chunks))
            if n == 0 and phase is Phase.P and s.seg_steps == 0 and s.phase is Phase.P and not chunks:
                n, c = self.prompts.fit(s.model, b, seq, math.inf, min(tokens, self.min_chunk))  # progress, over budget
                self.deadline_risk["prefill_over_budget"] += 1
            if n == 0:
                if phase is Phase.SP and not admitted:
                    self._park(s, seq, "budget")
                break
            if not admitted:
                if not b.admit(seq, now):
                    if phase is Phase.SP:
                        self._park(s, seq, "kv")
                    break
                n = min(n, seq.num_uncomputed)
            chunks.append(b.chunk(seq, n, admitted=not admitted))
            cost += c
            tokens -= n
            if phase is Phase.SP and not admitted:
                mine.add(seq.seq_id)
                joined.append(seq)
        if not chunks:
            return None
        if phase is Phase.SP:
            s.opportunities += 1
        step = self._step(s, now, phase, chunks, cost)  # ends the decode segment before the admissions
        for seq in joined:
            self._admitted(s, seq)
        return step

    def _opportunity(self, s: Slot, b: Batcher, now: float, paid: bool) -> SpOpportunity:
        """An SP step now, as sp_batch.py weighs it; `paid`: chunks already in it pay the fixed cost."""
        later = self.round.queue  # the model's next P: after this slot and the round's other slots
        after = sum(self.round.budgets[m] for m in later) + sum(self._switches([*later, s.model], s.model).values())
        return SpOpportunity(0.0 if paid else self.costs.prefill_fixed_s(s.model), max(0.0, s.budget_s - (now - s.start)),
                             after, self._sp_decode_s(s.model, b), tuple(q.num_generated for q in b.decoding), b.outputs)

    def _sp_decode_s(self, model: str, b: Batcher) -> float:
        """t_D of the slot's batch with one more sequence: the decode step an SP admission joins."""
        decoders = b.decoding
        return self.costs.decode_s(model, len(decoders) + 1, sum(len(q.token_ids) for q in decoders))

    @staticmethod
    def _must_finish(seq: Sequence) -> bool:
        """A running prompt this slot must prefill to the end, budget or not (see _in_slot)."""
        return seq.is_prefilling and seq.lost_tokens > 0

    def _eligible(self, s: Slot, b: Batcher, seq: Sequence) -> bool:
        """SP-eligible: a continuation of a session served here, arrived after P, with its prefix on
        this instance (device-resident or host-restorable)."""
        if seq.seq_id in s.p_set or seq.admitted_once or seq.call.session_id is None:
            return False
        return self._known(seq.call.session_id) and b.holds_prefix(seq)

    def _step(self, s: Slot, now: float, phase: Phase, chunks: list[SeqChunk], predicted: float) -> Step:
        if phase is not s.phase:
            self._end_segment(s, now)
            s.phase, s.seg_start = phase, now
        s.seg_steps += 1
        s.seg_tokens += sum(len(c.token_ids) for c in chunks)
        s.steps += 1
        s.last = phase
        self._pending = (s.model, phase, predicted, now)
        return Step(phase, tuple(chunks), predicted)

    def _end_segment(self, s: Slot, now: float) -> None:
        if s.seg_steps:
            self._emit(EventKind.SLOT_PHASE, model=s.model, phase=s.phase.value, round=self.round.number,
                       start=s.seg_start, duration_s=now - s.seg_start, steps=s.seg_steps, tokens=s.seg_tokens)
        s.seg_start, s.seg_steps, s.seg_tokens = now, 0, 0

    def _admitted(self, s: Slot, seq: Sequence) -> None:
        self.sp_admitted += 1
        self.round.sp_admitted += 1
        self._emit(EventKind.SP_ADMIT, model=s.model, session=seq.call.session_id, request=seq.call.request_id,
                   tokens=len(seq.token_ids), cached_tokens=seq.num_cached, restored_tokens=seq.num_restored,
                   round=self.round.number, opportunity=s.opportunities)

    def _park(self, s: Slot, seq: Sequence, reason: str) -> None:
        if seq.seq_id in s.parked:
            return
        s.parked.add(seq.seq_id)
        self.sp_parked += 1
        self.round.sp_parked += 1
        self._emit(EventKind.SP_PARK, model=s.model, session=seq.call.session_id, request=seq.call.request_id,
                   reason=reason, round=self.round.number)

    def _decode_step_s(self, model: str, batch: int | None = None) -> float:
        b = self.batchers[model]
        if batch is None:
            batch = max(1, len(b.running) + len(b.waiting))
        return self.costs.decode_s(model, batch, 0)

    # ---- telemetry ---------------------------------------------------------------------------

    def telemetry(self) -> dict:
        now, s, r = self.clock(), self.slot, self.round
        remaining = 0.0
        if r is not None:
            remaining = sum(r.budgets[m] for m in r.queue)
            if s is not None:
                remaining += max(0.0, s.budget_s - (now - s.start if s.start is not None else 0.0))
        return {
            "round": r.number if r else None,
            "round_remaining_s": remaining,
            "slot": None if s is None else s.telemetry(now),
            "deadline_risk": dict(self.deadline_risk),
            "sp_admitted": self.sp_admitted,
            "sp_parked": self.sp_parked,
            "rounds": list(self.summaries),
        }
