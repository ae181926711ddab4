"""`talaria.routing.leases`: soft reservations installed on completion, consumed once, expired exactly."""

from __future__ import annotations

from talaria.routing.leases import Lease, LeaseTable


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
