"""`talaria.routing.leases`: soft reservations installed on completion, consumed once, expired exactly."""

from __future__ import annotations

from talaria.routing.leases import (
    TAU_CEILING_S,
    TAU_FLOOR_SRTT,
    AdaptiveTau,
    Lease,
    LeaseTable,
)


def test_a_completion_installs_a_lease_that_charges_its_instance_until_taken():
    table = LeaseTable(1.5)
    lease = table.install("s", "m", "i0", 10.0)
    assert lease == Lease("s", "m", "i0", 10.0, 11.5)
    assert table.get("s", "m") is lease and table.get("s", "other") is None
    assert (table.count("i0"), table.count("i1"), len(table)) == (1, 0, 1)
    table.take(lease)
    assert table.get("s", "m") is None and table.count("i0") == 0 and len(table) == 0


def test_the_next_completion_replaces_the_lease_and_moves_its_charge():
    table = LeaseTable(1.0)
    table.install("s", "m", "i0", 0.0)
    second = table.install("s", "m", "i1", 0.5)
    assert table.get("s", "m") is second
    assert (table.count("i0"), table.count("i1")) == (0, 1)
    assert table.all() == [second]


def test_sweep_expires_exactly_the_leases_past_their_time_once_each():
    expired: list[Lease] = []
    table = LeaseTable(1.0, expired.append)
    a = table.install("a", "m", "i0", 0.0)  # t_exp 1.0
    table.install("b", "m", "i0", 0.5)  # t_exp 1.5, replaced below: its heap entry is stale
    b = table.install("b", "m", "i1", 0.8)  # t_exp 1.8
    c = table.install("c", "m", "i0", 0.9)  # t_exp 1.9, taken below: its heap entry is stale
    table.take(c)
    table.sweep(1.0)
    assert expired == []  # alive up to and including t_exp
    table.sweep(1.6)
    assert expired == [a]  # b's replaced entry at 1.5 is skipped, not reported
    table.sweep(10.0)
    assert expired == [a, b] and len(table) == 0 and table.count("i0") == table.count("i1") == 0


def test_tau_zero_turns_leases_off():
    table = LeaseTable(0.0)
    assert table.install("s", "m", "i0", 0.0) is None
    assert len(table) == 0 and table.count("i0") == 0


def test_the_heap_of_consumed_leases_stays_bounded():
    table = LeaseTable(3600.0)
    for i in range(20_000):
        table.take(table.install(f"s{i}", "m", "i0", float(i)))
    assert len(table) == 0
    assert len(table._heap) <= 1024 + 3  # compacted once stale entries pass 2 x live + 1024


def adaptive_table(lease_s: float = 1.0, capacity: int = 100_000) -> LeaseTable:
    return LeaseTable(lease_s, tau=AdaptiveTau(lease_s, capacity))


def serve(table: LeaseTable, t: float, session: str = "s") -> float:
    """A call of `session` arrives at `t` and completes at once: the new lease's lifetime."""
    table.arrived(session, "m", t)
    lease = table.install(session, "m", "i0", t)
    return lease.t_exp - lease.t_done


def test_adaptive_tau_is_lease_s_until_a_gap_then_the_smoothed_bound_of_the_sessions_gaps():
    table = adaptive_table(1.0)
    assert serve(table, 0.0) == 1.0  # no gap seen yet: lease_s
    assert serve(table, 3.0) == 9.0  # first gap 3 s: srtt 3, rttvar 1.5 -> 3 + 4 * 1.5
    assert serve(table, 6.0) == 7.5  # second 3 s gap: rttvar 0.75 * 1.5 -> 3 + 4 * 1.125
    assert serve(table, 0.0, "other") == 1.0  # tau is per session


def test_adaptive_tau_is_at_least_twice_the_mean_gap_and_at_most_the_ceiling():
    table = adaptive_table(1.0)
    t = 0.0
    for _ in range(40):  # steady 0.5 s gaps: rttvar decays to ~0, so the floor 2 x srtt holds
        tau = serve(table, t)
        t += 0.5
    assert tau == TAU_FLOOR_SRTT * 0.5
    slow = adaptive_table(1.0)
    serve(slow, 0.0)
    assert serve(slow, 60.0) == TAU_CEILING_S  # a 60 s tool run is sampled as the ceiling: srtt 10 -> 10 + 20, capped
    assert AdaptiveTau(30.0).ceiling_s == 30.0  # a longer configured lease_s is its own ceiling


def test_a_gap_is_sampled_once_per_completion_however_often_the_held_call_asks():
    table = adaptive_table(1.0)
    serve(table, 0.0)
    for t in (2.0, 2.05, 2.1, 5.0):  # a held call asks again: still the one 2 s gap
        table.arrived("s", "m", t)
    assert serve(table, 5.0) == 6.0  # srtt 2, rttvar 1 (one sample): 2 + 4
    table.arrived("nobody", "m", 1.0)  # never completed anything: nothing to measure
    assert len(table.tau) == 1


def test_adaptive_tau_forgets_the_least_recently_served_sessions_past_its_capacity():
    table = adaptive_table(1.0, capacity=2)
    for s in ("a", "b", "c"):
        serve(table, 0.0, s)
    for s in ("a", "b", "c"):
        table.arrived(s, "m", 2.0)  # a was forgotten when c completed: its gap is not measured
    assert [serve(table, 2.0, s) for s in ("b", "c", "a")] == [6.0, 6.0, 1.0]
