"""The thrash guard on exact numbers: which slots a round keeps, and their budgets."""

from __future__ import annotations

from talaria.instance.slot_policy import ThrashGuard, demand_split


def switches_after(active: str, costs: dict[str, float]):
    """Switch costs along a slot order starting from `active` (no switch into the active model's slot)."""
    def of(queue: list[str]) -> dict[str, float]:
        out, prev = {}, active
        for m in queue:
            out[m] = 0.0 if m == prev else costs[m]
            prev = m
        return out
    return of


def test_a_slot_worth_less_than_its_switch_is_deferred_and_the_rest_get_its_budget():
    guard = ThrashGuard(k=1.0, max_deferrals=2)
    demand = {"a": 3.0, "b": 3.0, "c": 0.5}
    queue, switches, budgets, deferred = guard.slots(["a", "b", "c"], demand,
                                                     switches_after("a", {"b": 1.0, "c": 1.0}), demand_split, 4.0)
    # unguarded: 2 s of switches, c's slot 2 x 0.5/6.5 = 0.15 s serves less than its 1 s switch
    assert deferred == ["c"] and queue == ["a", "b"]
    assert switches == {"a": 0.0, "b": 1.0} and budgets == {"a": 1.5, "b": 1.5}
    assert guard.deferrals["c"] == 1 and guard.deferrals["a"] == 0


def test_no_model_is_deferred_more_than_max_deferrals_rounds_in_a_row():
    guard = ThrashGuard(k=1.0, max_deferrals=2)
    demand = {"a": 3.0, "c": 0.5}
    kept = []
    for _ in range(4):
        queue, _, budgets, _ = guard.slots(["a", "c"], demand, switches_after("a", {"c": 1.0}),
                                                  demand_split, 4.0)
        kept.append(queue)
    assert kept == [["a"], ["a"], ["a", "c"], ["a"]]  # c waits two rounds, then is served, then may wait again
    assert budgets == {"a": 4.0}  # alone, a has the whole round


def test_a_starved_or_lone_slot_gets_at_least_k_times_its_switch():
    guard = ThrashGuard(k=1.0, max_deferrals=0)  # nothing may be deferred
    queue, _, budgets, deferred = guard.slots(["b", "c"], {"b": 5.0, "c": 0.4},
                                                     switches_after("a", {"b": 2.0, "c": 2.0}), demand_split, 3.0)
    assert deferred == [] and queue == ["b", "c"]
    # switches alone use 4 s of a 3 s round: each slot gets min(its work, k x switch) anyway
    assert budgets == {"b": 2.0, "c": 0.4}
