"""`talaria.routing.sessions`: where each session was last served, bounded in time and in number."""

from __future__ import annotations

import pytest

from talaria.routing.sessions import LastCall, SessionTable
from tests.instance.scheduler_harness import FakeClock


def test_an_entry_lives_for_its_ttl_after_the_call_finished():
    clock = FakeClock()
    table = SessionTable(10.0, clock)
    clock.now = 5.0
    table.put("s", "m", "i0", 300)
    assert table.get("s", "m") == LastCall("i0", 300, 5.0)
    assert table.get("s", "n") is None  # one entry per (session, model)
    clock.now = 15.0
    assert table.get("s", "m") is not None  # exactly ttl old
    assert table.get("s", "m", now=15.5) is None


def test_a_later_call_replaces_the_entry_and_counts_as_newest():
    clock = FakeClock()
    table = SessionTable(100.0, clock, capacity=2)
    table.put("a", "m", "i0")
    clock.now = 1.0
    table.put("b", "m", "i0")
    clock.now = 2.0
    table.put("a", "m", "i1", 50)  # a is newest now
    clock.now = 3.0
    table.put("c", "m", "i0")  # over capacity: the oldest, b, goes
    assert table.get("b", "m") is None
    assert table.get("a", "m") == LastCall("i1", 50, 2.0) and table.get("c", "m") is not None
    assert len(table) == 2


def test_a_put_evicts_expired_entries_from_the_front():
    clock = FakeClock()
    table = SessionTable(1.0, clock)
    for i in range(5):
        clock.now = float(i)
        table.put(f"s{i}", "m", "i0")
    assert len(table) == 2  # at 4.0, entries that finished before 3.0 are gone


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        SessionTable(1.0, FakeClock(), capacity=0)
