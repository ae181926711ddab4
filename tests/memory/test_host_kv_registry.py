"""HostKVRegistry on toy pools: slab ids, LRU eviction, DMA pins, two-phase saves, TP agreement."""

from __future__ import annotations

import pytest

from talaria.contracts.vocabulary import KVLocation
from talaria.memory.host_kv_registry import (
    HostKVRegistry,
    RankReport,
    RegistryStats,
    SaveEntry,
    agreed_pages,
)

M = "qwen"
PS = 4


def saved(reg: HostKVRegistry, chain: list[int], model: str = M) -> list[int]:
    """Save and publish every absent page of `chain`; returns the slabs reserved."""
    ticket = reg.begin_save(model, chain)
    assert ticket is not None
    reg.finish_save(ticket, len(chain))
    return [e.slab for e in ticket.entries]


# ---- slab ids and the two-phase save -------------------------------------------------------------


def test_begin_save_hands_out_the_lowest_free_slabs_in_chain_order():
    reg = HostKVRegistry(num_slabs=5, slab_bytes=64)
    t = reg.begin_save(M, [11, 12, 13])
    assert t is not None and t.model == M
    assert t.entries == (SaveEntry(0, 11, 0), SaveEntry(1, 12, 1), SaveEntry(2, 13, 2))
    u = reg.begin_save("glm", [21])
    assert u is not None and u.entries == (SaveEntry(0, 21, 3),)
    reg.abort_save(t)  # slabs 0, 1, 2 return to the pool
    v = reg.begin_save("glm", [21, 22, 23])  # page 0 is in flight already: not reserved twice
    assert v is not None and [(e.page_index, e.slab) for e in v.entries] == [(1, 0), (2, 1)]
    assert reg.budget_bytes == 5 * 64


def test_begin_save_starts_at_the_first_absent_page_and_fills_gaps():
    reg = HostKVRegistry(num_slabs=4, slab_bytes=1)
    assert saved(reg, [1]) == [0]
    assert saved(reg, [3]) == [1]  # page 2 of the chain below, saved without its parent
    t = reg.begin_save(M, [1, 2, 3, 4])
    assert t is not None and t.entries == (SaveEntry(1, 2, 2), SaveEntry(3, 4, 3))
    assert reg.begin_save(M, [1, 2, 3, 4]) is None  # everything present or in flight


def test_an_in_flight_prefix_is_never_matched_until_finish_save():
    reg = HostKVRegistry(num_slabs=4, slab_bytes=1)
    assert saved(reg, [1]) == [0]
    t = reg.begin_save(M, [1, 2, 3])
    assert t is not None
    assert reg.match(M, [1, 2, 3]) == [0]  # the head only: pages 1 and 2 are being copied
    assert reg.location(M, [1, 2, 3], min_pages=2) is KVLocation.MISSING
    reg.finish_save(t, 3)
    assert reg.match(M, [1, 2, 3]) == [0, 1, 2]
    assert reg.location(M, [1, 2, 3], min_pages=3) is KVLocation.HOST
    assert reg.location(M, [1, 2, 3, 4], min_pages=4) is KVLocation.MISSING
    assert reg.location(M, [5]) is KVLocation.MISSING


def test_finish_save_publishes_only_the_agreed_head_and_frees_the_tail():
    reg = HostKVRegistry(num_slabs=5, slab_bytes=1)
    assert saved(reg, [1]) == [0]
    t = reg.begin_save(M, [1, 2, 3, 4])
    assert t is not None and [e.slab for e in t.entries] == [1, 2, 3]
    reg.finish_save(t, 2)  # counted in chain pages: page 0 (present) and page 1 (slab 1)
    assert reg.match(M, [1, 2, 3, 4]) == [0, 1]
    s = reg.stats()
    assert (s.used, s.published, s.in_flight, s.pinned, s.saves) == (2, 2, 0, 0, 2)
    u = reg.begin_save(M, [1, 2, 3])  # the freed tail is saved again into the lowest slab
    assert u is not None and u.entries == (SaveEntry(2, 3, 2),)
    reg.finish_save(u, 0)  # no rank agreement at all: nothing new is published
    assert reg.match(M, [1, 2, 3]) == [0, 1]
    assert reg.stats().used == 2


def test_abort_save_frees_every_slab_and_tickets_are_taken_once():
    reg = HostKVRegistry(num_slabs=3, slab_bytes=1)
    t = reg.begin_save(M, [1, 2])
    assert t is not None
    assert reg.pending(M) == (t,) and reg.pending("glm") == ()
    reg.abort_save(t)
    assert reg.pending(M) == ()
    assert reg.match(M, [1, 2]) == []
    assert reg.stats() == RegistryStats(3, 0, 0, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="unknown or already finished"):
        reg.finish_save(t, 2)
    with pytest.raises(ValueError, match="unknown or already finished"):
        reg.abort_save(t)
    other = HostKVRegistry(num_slabs=3, slab_bytes=1).begin_save(M, [9])
    assert other is not None
    with pytest.raises(ValueError, match="save ticket 0 of model 'qwen' is unknown"):
        reg.finish_save(other, 1)  # a ticket of another registry
    u = reg.begin_save(M, [1])
    assert u is not None
    with pytest.raises(ValueError, match="agreed_pages must be >= 0"):
        reg.finish_save(u, -1)
    assert reg.pending(M) == (u,)  # the rejected call left the ticket in flight


# ---- eviction and pins ---------------------------------------------------------------------------


def test_eviction_is_least_recently_matched_or_published_first():
    reg = HostKVRegistry(num_slabs=3, slab_bytes=1)
    assert [saved(reg, [h]) for h in (10, 20, 30)] == [[0], [1], [2]]
    assert reg.match(M, [10]) == [0]  # 10 is now the most recent: 20 is the oldest
    assert saved(reg, [40]) == [1]
    assert reg.match(M, [20]) == []
    assert saved(reg, [50]) == [2]  # then 30
    assert saved(reg, [60]) == [0]  # then 10, matched before 40 and 50 were published
    assert [reg.match(M, [h]) for h in (40, 50, 60)] == [[1], [2], [0]]
    assert reg.stats().evictions == 3


def test_a_chains_tail_is_evicted_before_its_head():
    reg = HostKVRegistry(num_slabs=3, slab_bytes=1)
    assert saved(reg, [1, 2, 3]) == [0, 1, 2]
    assert saved(reg, [7], model="glm") == [2]
    assert reg.location(M, [1, 2, 3], min_pages=3) is KVLocation.MISSING
    assert reg.location(M, [1, 2, 3], min_pages=2) is KVLocation.HOST  # a query: no refresh
    assert saved(reg, [8], model="glm") == [1]  # page 1 of the chain, older than glm's page 7
    assert reg.match(M, [1, 2, 3]) == [0]


def test_a_save_never_evicts_its_own_chains_pages():
    reg = HostKVRegistry(num_slabs=2, slab_bytes=1)
    assert saved(reg, [1]) == [0]  # the least recent entry...
    assert saved(reg, [9], model="glm") == [1]
    t = reg.begin_save(M, [1, 2])  # ...but it is the head of this chain: evict glm's page
    assert t is not None and t.entries == (SaveEntry(1, 2, 1),)
    reg.finish_save(t, 2)
    assert reg.match(M, [1, 2]) == [0, 1]
    assert reg.match("glm", [9]) == []
    assert reg.begin_save(M, [1, 2, 3]) is None  # the only candidates are its own head pages
    assert reg.match(M, [1, 2]) == [0, 1]


def test_a_slab_pinned_by_a_restore_is_never_evicted():
    reg = HostKVRegistry(num_slabs=2, slab_bytes=1)
    assert saved(reg, [10]) == [0]
    assert saved(reg, [20]) == [1]
    slabs = reg.match(M, [10])
    reg.pin(slabs)
    reg.pin(slabs)  # two restores read the same prefix
    assert reg.match(M, [20]) == [1]  # 10 is older, but pinned
    t = reg.begin_save(M, [30])
    assert t is not None and t.entries == (SaveEntry(0, 30, 1),)
    assert reg.begin_save(M, [40]) is None  # slab 0 pinned by restores, slab 1 by the save
    assert reg.match(M, [10]) == [0]  # a pinned entry stays matchable
    reg.unpin(slabs)
    assert reg.begin_save(M, [40]) is None  # one restore still reads it
    reg.unpin(slabs)
    u = reg.begin_save(M, [40])
    assert u is not None and u.entries == (SaveEntry(0, 40, 0),)
    assert reg.match(M, [10]) == []


def test_save_in_flight_pins_its_slabs():
    reg = HostKVRegistry(num_slabs=2, slab_bytes=1)
    t = reg.begin_save(M, [1, 2])
    assert t is not None
    assert reg.begin_save("glm", [5]) is None
    s = reg.stats()
    assert (s.used, s.pinned, s.in_flight, s.published) == (2, 2, 2, 0)
    reg.finish_save(t, 1)
    u = reg.begin_save("glm", [5])  # the freed tail first, no eviction needed
    assert u is not None and u.entries == (SaveEntry(0, 5, 1),)
    assert reg.stats().evictions == 0


def test_a_tight_budget_reserves_the_longest_prefix_that_fits():
    reg = HostKVRegistry(num_slabs=3, slab_bytes=1)
    assert saved(reg, [99], model="glm") == [0]
    reg.pin(reg.match("glm", [99]))
    t = reg.begin_save(M, [1, 2, 3, 4])
    assert t is not None and t.entries == (SaveEntry(0, 1, 1), SaveEntry(1, 2, 2))
    reg.finish_save(t, 4)
    assert reg.match(M, [1, 2, 3, 4]) == [1, 2]
    assert reg.match("glm", [99]) == [0]


def test_pin_and_unpin_reject_slabs_a_restore_cannot_hold():
    reg = HostKVRegistry(num_slabs=3, slab_bytes=1)
    t = reg.begin_save(M, [1])
    assert t is not None
    with pytest.raises(ValueError, match="slab 0 holds no published entry"):
        reg.pin([0])  # in flight
    with pytest.raises(ValueError, match="slab 2 holds no published entry"):
        reg.pin([2])  # free
    reg.finish_save(t, 1)
    with pytest.raises(ValueError, match="slab 0 is not pinned by a restore"):
        reg.unpin([0])
    assert reg.stats().pinned == 0


# ---- models, stats, construction ----------------------------------------------------------------


def test_two_models_with_the_same_hashes_do_not_collide():
    reg = HostKVRegistry(num_slabs=4, slab_bytes=1)
    assert saved(reg, [1, 2], model="a") == [0, 1]
    assert reg.match("b", [1, 2]) == []
    assert saved(reg, [1, 2], model="b") == [2, 3]
    assert reg.match("a", [1, 2]) == [0, 1]
    assert reg.match("b", [1, 2]) == [2, 3]


def test_stats_count_hits_saves_evictions_and_pins():
    reg = HostKVRegistry(num_slabs=2, slab_bytes=1)
    saved(reg, [1, 2])
    assert reg.match(M, [1, 2, 3]) == [0, 1]
    assert reg.match(M, [5]) == []
    reg.location(M, [1, 2], min_pages=2)  # a query: no hit counted, no recency change
    reg.pin([1])
    t = reg.begin_save(M, [7])
    assert t is not None and t.entries == (SaveEntry(0, 7, 0),)
    assert reg.stats() == RegistryStats(num_slabs=2, used=2, pinned=2, published=1, in_flight=1,
                                        hits=2, saves=2, evictions=1)


def test_location_rejects_a_non_positive_minimum():
    with pytest.raises(ValueError, match="min_pages must be at least 1"):
        HostKVRegistry(1, 1).location(M, [1], min_pages=0)


def test_construction_needs_positive_sizes_and_from_budget_rounds_down():
    assert HostKVRegistry.from_budget(1000, 300).num_slabs == 3
    with pytest.raises(ValueError, match="0 slabs of 300 bytes"):
        HostKVRegistry.from_budget(299, 300)
    with pytest.raises(ValueError, match="positive sizes"):
        HostKVRegistry(4, 0)


# ---- TP agreement --------------------------------------------------------------------------------


def test_agreed_pages_of_equal_reports_is_every_full_page():
    r = RankReport(committed_tokens=12, chain=(1, 2, 3))
    assert agreed_pages([r, r, r, r], PS) == 3


def test_agreed_pages_stops_at_the_shortest_rank():
    full = RankReport(12, (1, 2, 3))
    assert agreed_pages([full, RankReport(12, (1, 2))], PS) == 2  # shorter chain
    assert agreed_pages([full, RankReport(5, (1, 2, 3))], PS) == 1  # fewer committed tokens


def test_agreed_pages_stops_at_a_flipped_hash_in_the_middle():
    good = RankReport(16, (1, 2, 3, 4))
    bad = RankReport(16, (1, 2, 99, 4))
    assert agreed_pages([good, good, bad, good], PS) == 2
    assert agreed_pages([bad, good], PS) == 2
    assert agreed_pages([RankReport(16, (0, 2, 3, 4)), good], PS) == 0


def test_agreed_pages_counts_only_page_aligned_committed_tokens():
    assert agreed_pages([RankReport(11, (1, 2, 3))], PS) == 2
    assert agreed_pages([RankReport(3, (1, 2, 3))], PS) == 0
    assert agreed_pages([RankReport(16, (1, 2, 3))], PS) == 3  # the chain bounds it too


def test_agreed_pages_of_a_single_rank_and_bad_input():
    assert agreed_pages([RankReport(8, (1, 2))], PS) == 2
    with pytest.raises(ValueError, match="at least one rank report"):
        agreed_pages([], PS)
    with pytest.raises(ValueError, match="page_size must be positive"):
        agreed_pages([RankReport(8, (1, 2))], 0)
