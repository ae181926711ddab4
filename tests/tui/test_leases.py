"""LeaseBook.reconcile: the router's lease list from a snapshot repairs, but never undoes, the events."""

from __future__ import annotations

import pytest

from talaria.tui.leases import LISTED_MAX, LeaseBook
from tests.tui.events import lease


def listed(session: str, expires_in_s: float, model: str = "tiny-llama", instance: str = "cold-0") -> dict:
    return {"session": session, "model": model, "instance": instance, "expires_in_s": expires_in_s}


def test_a_listed_lease_the_events_missed_is_added_on_the_node_clock():
    book = LeaseBook()
    book.reconcile([listed("s1", 0.5)], t=200.0)
    (x,) = book.live()
    assert (x.session, x.t_exp, x.kv_tokens) == ("s1", 200.5, None)
    assert x.fraction(200.0) == 1.0 and x.remaining(200.25) == pytest.approx(0.25)


def test_an_older_snapshot_does_not_bring_back_a_lease_that_ended_after_it():
    book = LeaseBook()
    book.apply(lease(1, 200.0, "install", "s1", t_exp=201.0))
    book.apply(lease(2, 201.0, "expire", "s1"))
    book.reconcile([listed("s1", 0.1)], t=200.9)
    assert book.live() == []
    book.reconcile([listed("s1", 0.8)], t=201.2)  # newer than the expiry: a new lease whose install we missed
    assert [x.t_exp for x in book.live()] == [202.0]


def test_a_lease_installed_after_the_snapshot_is_kept_and_one_before_it_is_dropped():
    book = LeaseBook()
    book.apply(lease(1, 202.0, "install", "s1", t_exp=203.0))
    book.reconcile([], t=201.5)
    assert [x.session for x in book.live()] == ["s1"]
    book.reconcile([], t=202.5)  # the router no longer has it: its end event was lost
    assert book.live() == []


def test_a_truncated_list_drops_nothing():
    book = LeaseBook()
    book.apply(lease(1, 1.0, "install", "mine", t_exp=9.0))
    book.reconcile([listed(f"s{i}", 5.0) for i in range(LISTED_MAX)], t=2.0)
    assert "mine" in {x.session for x in book.live()} and len(book.live()) == LISTED_MAX + 1
