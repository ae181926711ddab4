"""Small strategy objects for cold-pool rounds: which model's slot comes next, how long it is, and
which slots are worth their switch.

Chosen by config (`slot_order`, `slot_length` in `[[instances]]`); the round scheduler calls them
once per round with the models that have work.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from talaria.config.schema import SlotLength, SlotOrder

SlotOrderFn = Callable[[list[str], list[str], str | None, dict[str, float]], list[str]]
SlotLengthFn = Callable[[float, dict[str, float]], dict[str, float]]


def round_robin(with_work: list[str], order: list[str], active: str | None, demand: dict[str, float]) -> list[str]:
    """Config order, starting from the active model so a round never opens with a switch it can avoid."""
    start = order.index(active) if active in order else 0
    rotation = order[start:] + order[:start]
    return [m for m in rotation if m in with_work]


def longest_queue(with_work: list[str], order: list[str], active: str | None, demand: dict[str, float]) -> list[str]:
    """The active model first (no switch), then the others by predicted work, most first."""
    rest = sorted((m for m in with_work if m != active), key=lambda m: (-demand[m], order.index(m)))
    return ([active] if active in with_work else []) + rest


def demand_split(available_s: float, demand: dict[str, float]) -> dict[str, float]:
    """Slot budgets in proportion to each model's predicted work."""
    total = sum(demand.values())
    if total <= 0:
        return equal_split(available_s, demand)
    return {m: available_s * d / total for m, d in demand.items()}


def equal_split(available_s: float, demand: dict[str, float]) -> dict[str, float]:
    return {m: available_s / len(demand) for m in demand} if demand else {}


class ThrashGuard:
    """A slot that needs a switch must be predicted to serve at least k x what opening it costs: the
    switch, and the fixed cost of its P's first step (however many prompts the step batches).

    Served work is the slot's budget or the model's predicted work, whichever is less, less that
    fixed cost. While some slot falls short, the least worthwhile one (served / opening) leaves the
    round and the budgets are split again among the rest, whose switches change with the order. A
    model is left out at most `max_deferrals` rounds in a row (the starvation bound); every slot that
    switches, a starved model's or a lone model's, then gets at least its fixed cost plus k x its
    opening (or its whole work) in budget, round bound or not. At k = 1 no slot spends more time
    opening than serving; a deferred model's queue is prefilled later under one fixed cost.
    """

    def __init__(self, k: float, max_deferrals: int) -> None:
        self.k = k
        self.max_deferrals = max_deferrals
        self.deferrals: Counter = Counter()  # model -> rounds in a row it was left out

    def slots(self, queue: list[str], demand: dict[str, float], switches_of: Callable[[list[str]], dict[str, float]],
              split: SlotLengthFn, round_s: float, fixed: dict[str, float] | None = None,
              ) -> tuple[list[str], dict[str, float], dict[str, float], list[str]]:
        """(the slots kept, in order; their predicted switches; their budgets; the models left out).
        `fixed`: the prefill fixed cost opening each model's slot pays (0 when nothing is queued for its
        P), part of its `demand` (none: 0 for every model)."""
        fixed = {m: (fixed or {}).get(m, 0.0) for m in queue}
        queue, deferred = list(queue), []
        while True:
            switches = switches_of(queue)
            budgets = split(max(0.0, round_s - sum(switches.values())), {m: demand[m] for m in queue})
            opening = {m: switches[m] + fixed[m] for m in queue}
            served = {m: min(budgets[m], demand[m]) - fixed[m] for m in queue}
            short = [m for m in queue if switches[m] > 0 and self.deferrals[m] < self.max_deferrals
                     and served[m] < self.k * opening[m]]
            if not short or len(queue) == 1:
                break
            worst = min(short, key=lambda m: served[m] / opening[m])
            queue.remove(worst)
            deferred.append(worst)
        for m in queue:
            self.deferrals[m] = 0
            if switches[m] > 0:
                budgets[m] = max(budgets[m], min(demand[m], fixed[m] + self.k * opening[m]))
        for m in deferred:
            self.deferrals[m] += 1
        return queue, switches, budgets, deferred


SLOT_ORDERS: dict[SlotOrder, SlotOrderFn] = {
    SlotOrder.ROUND_ROBIN: round_robin,
    SlotOrder.LONGEST_QUEUE: longest_queue,
}
SLOT_LENGTHS: dict[SlotLength, SlotLengthFn] = {
    SlotLength.DEMAND: demand_split,
    SlotLength.EQUAL: equal_split,
}
