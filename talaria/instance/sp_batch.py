"""Which waiting continuations a session-prefill (SP) step admits (paper §3.4; issue 20, item 4).

Chosen by config (`sp_batch` in `[[instances]]`); the round scheduler calls one at every SP
opportunity that has continuations waiting, with the candidates in arrival order, once the
model's prefill fixed cost fits a decode step's TPOT slack (`within_tpot_slack`; where it does not,
no SP step runs).

- `paper`: every eligible continuation, in arrival order; the budget left after protected decode
  bounds the batch (paper §3.4). Free when a prefill step's fixed cost is small.
- `pays`: an SP step is an extra prefill step in the slot. It pays the step's fixed cost once more,
  and every sequence decoding in the slot waits for it; left alone, the continuations would be
  served by the model's next P step, which pays that fixed cost once for its whole queue. So the
  step runs only when the completions it brings forward outweigh those it pushes back, all from the
  scheduler's own predictions (no constant in it is fitted):

      c      the step: its fixed cost (0 when chunks already in it pay it) + each admitted
             continuation's work w_i (its host restore and the prefill of its uncached tail)
      T, L   the slot's budget left; from the slot's end to the model's next P (the budgets of the
             round's slots still queued, and the switches into them and back; 0 in its last slot)
      ends   when the slot would end without the step: T while anything decodes, else now (0)
      p      the chance an admitted call completes in the slot: the share of the outputs of this
             model's calls finished here that end within (T - c) / t_D decode steps
      pushed for each decoder, the chance the step pushes its end past the slot's: of the outputs
             longer than what it generated, the share that end (T - c) / t_D to T / t_D steps on

  Each admitted continuation gains p (W - c + w_i) + (1 - p) max(0, ends - c), W = ends + L being
  when the next P would serve it (it completes in the slot, or gets only the decode it does here);
  the step costs c for each decoder and L for each decoder pushed past the slot's end. Candidates are
  ranked by predicted remaining work (w_i), shortest first, and the step admits the prefix of that
  ranking with the largest positive net; none when no prefix gains (they wait for the next P, or a
  later opportunity of this slot). Measured in docs/simulator.md ("SP batch selection"): it helped
  where the prefill fixed cost is large (where the TPOT gate now takes no SP step at all) and loses
  where it is a forward's, so it is off by default.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from talaria.config.schema import SpBatch

T = TypeVar("T")


def share(outputs: Sequence[int], generated: int, lo: float, hi: float) -> float:
    """Of the observed outputs (sorted) longer than `generated` tokens, the share that ended after
    more than `lo` and at most `hi` further tokens: the chance a call that has generated `generated`
    tokens finishes in that window. 0 when no observed output is that long."""
    above = len(outputs) - bisect_right(outputs, generated)
    if above <= 0 or hi <= lo:
        return 0.0
    return (bisect_right(outputs, generated + hi) - bisect_right(outputs, generated + lo)) / above


@dataclass(frozen=True, slots=True)
class SpOpportunity:
    """What an SP step at this decode boundary would cost and save, as the round scheduler predicts it."""

    fixed_s: float  # the step's fixed cost; 0 when chunks already in the step pay it
    left_s: float  # T: the slot's budget left
    later_s: float  # L: from the slot's end to the model's next P (the round's later slots and switches)
    step_s: float  # t_D: one decode step of the slot's batch
    generated: tuple[int, ...]  # tokens each decoding sequence has generated so far
    outputs: Sequence[int]  # output lengths of the model's calls finished here, sorted (empty: none yet)

    def net_s(self, works: list[float]) -> float:
        """Seconds of completion brought forward, less those pushed back, by a step admitting `works`."""
        c, t, n = self.fixed_s + sum(works), self.left_s, len(self.generated)
        ends = t if n else 0.0  # without the step the slot runs to its budget, or ends now if nothing decodes
        wait = ends + self.later_s  # until the next P would serve the candidates
        p = share(self.outputs, 0, 0, (t - c) / self.step_s) if self.outputs else 1.0
        gain = sum(p * (wait - c + w) + (1 - p) * max(0.0, ends - c) for w in works)
        pushed = sum(share(self.outputs, g, (t - c) / self.step_s, t / self.step_s) for g in self.generated)
        return gain - c * n - pushed * self.later_s


def within_tpot_slack(fixed_s: float, step_s: float, tpot_s: float) -> bool:
    """Whether an SP step is taken at this opportunity: it stalls every decoding sequence of the slot
    for its whole time, so it is taken only when the model's prefill fixed cost (what it adds over
    serving the calls in the next P) fits one decode step's TPOT slack, T_tpot - t_D (the paper's SP
    inserts a prefill whose fixed cost is a forward's between two decode steps). Where it does not,
    continuations wait for a later opportunity or the next P, under one fixed cost."""
    return fixed_s <= tpot_s - step_s


SpBatchFn = Callable[[list[T], Callable[[T], float], Callable[[], SpOpportunity]], list[T]]


def paper(candidates: list[T], work: Callable[[T], float], opportunity: Callable[[], SpOpportunity]) -> list[T]:
    """Every candidate, in arrival order: the budget alone bounds the batch."""
    return candidates


def pays(candidates: list[T], work: Callable[[T], float], opportunity: Callable[[], SpOpportunity]) -> list[T]:
    """The shortest-work-first prefix of the candidates with the largest net gain; [] when none gains."""
    o = opportunity()
    ranked = sorted(((work(q), i) for i, q in enumerate(candidates)))
    best, best_net = 0, 0.0
    for k in range(1, len(ranked) + 1):
        net = o.net_s([w for w, _ in ranked[:k]])
        if net > best_net:
            best, best_net = k, net
    return [candidates[i] for _, i in ranked[:best]]


SP_BATCHES: dict[SpBatch, SpBatchFn] = {
    SpBatch.PAPER: paper,
    SpBatch.PAYS: pays,
}
