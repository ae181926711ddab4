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


def test_a_slot_is_worth_its_switch_and_its_prefill_fixed_cost_together():
    """c's slot would get 1 s of budget for 1.5 s of work behind a 0.5 s switch: worth it when a
    prefill step costs only its tokens, not when its P pays a 1 s fixed cost out of that second
    (served 0 s < k x (0.5 + 1) s). Deferred, its queue is prefilled later under one fixed cost."""
    demand, switches = {"a": 3.0, "b": 3.0, "c": 1.5}, switches_after("a", {"b": 0.5, "c": 0.5})
    kept = ThrashGuard(k=1.0, max_deferrals=2).slots(["a", "b", "c"], demand, switches, demand_split, 6.0)
    assert kept[0] == ["a", "b", "c"] and kept[2] == {"a": 2.0, "b": 2.0, "c": 1.0}
    queue, _, budgets, deferred = ThrashGuard(k=1.0, max_deferrals=2).slots(
        ["a", "b", "c"], demand, switches, demand_split, 6.0, fixed={"c": 1.0})
    assert queue == ["a", "b"] and deferred == ["c"] and budgets == {"a": 2.75, "b": 2.75}


def test_a_starved_slot_gets_its_fixed_cost_and_k_times_its_opening():
    guard = ThrashGuard(k=1.0, max_deferrals=0)
    _, _, budgets, _ = guard.slots(["b", "c"], {"b": 5.0, "c": 5.0}, switches_after("a", {"b": 2.0, "c": 2.0}),
                                   demand_split, 3.0, fixed={"c": 1.0})
    assert budgets == {"b": 2.0, "c": 4.0}  # c: its 1 s fixed cost + 1 x (2 s switch + 1 s); b: 1 x its 2 s switch
