"""Small strategy objects for cold-pool rounds: which model's slot comes next, and how long it is.

Chosen by config (`slot_order`, `slot_length` in `[[instances]]`); the round scheduler calls them
once per round with the models that have work.
"""

from __future__ import annotations

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


SLOT_ORDERS: dict[SlotOrder, SlotOrderFn] = {
    SlotOrder.ROUND_ROBIN: round_robin,
    SlotOrder.LONGEST_QUEUE: longest_queue,
}
SLOT_LENGTHS: dict[SlotLength, SlotLengthFn] = {
    SlotLength.DEMAND: demand_split,
    SlotLength.EQUAL: equal_split,
}
