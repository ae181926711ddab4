"""PageManager on toy pools: exact page ids, ref counts, LRU eviction, pins, blocked pages and the
prefix-hash chain."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from talaria.memory.page_manager import ROOT_HASH, PageManager, page_hash

PS = 4


def published(pm: PageManager, pages: list[int]) -> list[int]:
    """Publish `pages` under distinct fake hashes 1000 + page id; returns the hashes."""
    hashes = [1000 + p for p in pages]
    for p, h in zip(pages, hashes):
        pm.publish(p, h)
    return hashes


# ---- allocation and ref counts ---------------------------------------------------------------


def test_allocate_takes_the_lowest_clean_pages_first():
    pm = PageManager(8, PS)
    assert pm.allocate(3) == [0, 1, 2]
    assert pm.allocate(2) == [3, 4]
    assert (pm.num_free, pm.num_used) == (3, 5)
    pm.release([0, 1, 2])  # unpublished: back to the clean heap, so the low ids go first again
    assert pm.allocate(5) == [0, 1, 2, 5, 6]
    assert pm.num_free == 1 and pm.is_free(7)


def test_lowest_clean_page_goes_first_whatever_the_release_order():
    pm = PageManager(8, PS)
    assert pm.allocate(6) == [0, 1, 2, 3, 4, 5]
    for p in (4, 1, 3):  # neither the first nor the last released comes back first
        pm.release([p])
    assert pm.allocate(1) == [1]
    pm.release([0])
    assert pm.allocate(2) == [0, 3]
    assert pm.allocate(2) == [4, 6]
    assert (pm.num_free, pm.is_free(7)) == (1, True)


def test_allocate_beyond_free_raises_and_takes_nothing():
    pm = PageManager(4, PS)
    assert pm.allocate(2) == [0, 1]
    hashes = published(pm, [0])
    pm.release([0])
    with pytest.raises(MemoryError, match="need 4 pages, 3 free"):
        pm.allocate(4)
    assert pm.num_free == 3
    assert pm.match_prefix(hashes) == [0]  # the failed call evicted nothing
    assert pm.allocate(3) == [2, 3, 0]  # clean pages first, then the still-cached page 0


def test_failed_allocate_keeps_eviction_order_blocked_pages_and_skips_on_allocate():
    blocked: set[int] = set()
    log: list[list[int]] = []
    pm = PageManager(6, PS, blocked=lambda: blocked, on_allocate=log.append)
    assert pm.allocate(6) == [0, 1, 2, 3, 4, 5]
    hashes = dict(zip((1, 2, 3), published(pm, [1, 2, 3])))
    pm.release([4])  # clean
    pm.release([1, 2, 3])  # cached, tail first: 3, 2, 1
    blocked.add(4)
    assert pm.num_free == 3
    with pytest.raises(MemoryError, match="need 4 pages, 3 free"):
        pm.allocate(4)
    assert pm.num_free == 3
    assert log == [[0, 1, 2, 3, 4, 5]]  # no callback for an allocation that did not happen
    assert [pm.match_prefix([hashes[p]]) for p in (1, 2, 3)] == [[1], [2], [3]]
    assert pm.allocate(1) == [3]  # still least recently freed first; 4 still blocked
    assert pm.allocate(1) == [2]
    blocked.clear()
    assert pm.allocate(1) == [4]
    assert pm.match_prefix([hashes[1]]) == [1]


def test_acquire_and_release_count_references():
    pm = PageManager(2, PS)
    assert pm.allocate(2) == [0, 1]
    pm.acquire([0])  # a second sequence shares page 0
    pm.release([0, 1])
    assert not pm.is_free(0) and pm.is_free(1)
    assert pm.num_free == 1
    assert pm.allocate(1) == [1]
    with pytest.raises(MemoryError):
        pm.allocate(1)  # page 0 still has one reference
    pm.release([0])
    assert pm.is_free(0)
    assert pm.allocate(1) == [0]


def test_acquire_of_a_free_cached_page_makes_it_unallocatable():
    pm = PageManager(3, PS)
    assert pm.allocate(3) == [0, 1, 2]
    hashes = published(pm, [0])
    pm.release([0, 1, 2])
    assert pm.num_free == 3
    pm.acquire(pm.match_prefix(hashes))
    assert pm.num_free == 2 and not pm.is_free(0)
    assert pm.allocate(2) == [1, 2]
    with pytest.raises(MemoryError, match="need 1 pages, 0 free"):
        pm.allocate(1)  # page 0 is neither handed out nor evicted while referenced
    assert pm.match_prefix(hashes) == [0]


# ---- the prefix cache and eviction --------------------------------------------------------------


def test_released_published_page_stays_matchable_until_evicted():
    pm = PageManager(2, PS)
    assert pm.allocate(1) == [0]
    hashes = published(pm, [0])
    pm.release([0])
    assert pm.is_free(0)
    assert pm.match_prefix(hashes) == [0]
    assert pm.allocate(1) == [1]  # a never-used page goes first: page 0 stays cached
    assert pm.match_prefix(hashes) == [0]
    assert pm.allocate(1) == [0]  # now it is evicted
    assert pm.match_prefix(hashes) == []


def test_cached_pages_are_evicted_only_when_no_clean_page_is_left_oldest_release_first():
    pm = PageManager(6, PS)
    assert pm.allocate(6) == [0, 1, 2, 3, 4, 5]
    h = dict(zip(range(4), published(pm, [0, 1, 2, 3])))
    pm.release([0, 1])  # a two-page sequence: tail 1 is freed before head 0
    pm.release([4])  # unpublished: clean, although freed after 0 and 1
    pm.release([2, 3])
    pm.release([5])
    assert pm.num_free == 6
    assert pm.allocate(3) == [4, 5, 1]  # every clean page, then the oldest cached: the tail 1
    assert pm.match_prefix([h[1]]) == []
    assert [pm.match_prefix([h[p]]) for p in (0, 2, 3)] == [[0], [2], [3]]
    assert pm.allocate(2) == [0, 3]
    assert pm.match_prefix([h[2]]) == [2]
    assert pm.allocate(1) == [2]
    assert pm.num_free == 0


def test_eviction_is_least_recently_released_first():
    pm = PageManager(4, PS)
    assert pm.allocate(4) == [0, 1, 2, 3]
    h = dict(zip(range(4), published(pm, [0, 1, 2, 3])))
    for p in (1, 3, 0, 2):
        pm.release([p])
    assert pm.allocate(1) == [1]
    assert pm.match_prefix([h[1]]) == []
    assert [pm.match_prefix([h[p]]) for p in (0, 2, 3)] == [[0], [2], [3]]
    pm.acquire([3])  # a prefix hit, then released again: now the most recent
    pm.release([3])
    assert pm.allocate(2) == [0, 2]
    assert pm.match_prefix([h[3]]) == [3]
    assert pm.match_prefix([h[0]]) == pm.match_prefix([h[2]]) == []


def test_a_sequences_tail_pages_are_evicted_before_its_head_pages():
    pm = PageManager(4, PS)
    tokens = list(range(12))
    chain = pm.extend_chain([], tokens)
    pages = pm.allocate(3)
    for p, h in zip(pages, chain):
        pm.publish(p, h)
    pm.release(pages)
    assert pm.allocate(1) == [3]  # the never-used page first
    assert pm.allocate(1) == [2]  # then the tail of the released sequence
    assert pm.match_prefix(chain) == [0, 1]
    assert pm.allocate(1) == [1]
    assert pm.match_prefix(chain) == [0]


def test_publish_of_duplicate_content_keeps_the_first_page():
    pm = PageManager(3, PS)
    pm.allocate(3)
    pm.publish(0, 77)
    pm.publish(1, 77)  # same content computed again elsewhere
    assert pm.match_prefix([77]) == [0]
    pm.publish(0, 88)  # a published page keeps its first hash
    assert pm.match_prefix([88]) == []
    pm.release([1])
    assert pm.allocate(1) == [1]  # evicting the duplicate does not drop the cached entry
    assert pm.match_prefix([77]) == [0]


def test_match_prefix_stops_at_the_first_miss():
    pm = PageManager(4, PS)
    pm.allocate(4)
    pm.publish(0, 10)
    pm.publish(2, 30)
    pm.publish(3, 40)
    assert pm.match_prefix([10, 20, 30, 40]) == [0]
    assert pm.match_prefix([20, 30, 40]) == []
    assert pm.match_prefix([10]) == [0]
    assert pm.match_prefix([]) == []


# ---- DMA pins, blocked pages and the allocation callback ----------------------------------------


def test_page_whose_last_ref_is_dropped_while_pinned_is_freed_by_unpin():
    pm = PageManager(3, PS)
    assert pm.allocate(3) == [0, 1, 2]
    pm.pin([1])  # a host save reads page 1
    pm.release([0, 1, 2])
    assert (pm.is_free(1), pm.num_free, pm.num_used) == (False, 2, 1)
    assert pm.allocate(2) == [0, 2]
    with pytest.raises(MemoryError, match="need 1 pages, 0 free"):
        pm.allocate(1)
    pm.unpin([1])
    assert (pm.is_free(1), pm.num_free) == (True, 1)
    assert pm.allocate(1) == [1]


def test_unpin_keeps_a_page_that_is_still_referenced():
    pm = PageManager(2, PS)
    assert pm.allocate(2) == [0, 1]
    pm.pin([0])
    pm.unpin([0])
    assert not pm.is_free(0) and pm.num_free == 0
    pm.release([0])
    assert pm.allocate(1) == [0]


def test_pinned_published_page_stays_matchable_and_joins_the_lru_at_unpin():
    pm = PageManager(4, PS)
    assert pm.allocate(3) == [0, 1, 2]
    hashes = published(pm, [0, 1, 2])
    pm.pin([1])
    pm.release([0, 1, 2])  # cached: 2, 0; page 1 is held by its pin
    assert pm.match_prefix(hashes) == [0, 1, 2]
    assert pm.num_free == 3
    assert pm.allocate(3) == [3, 2, 0]  # the clean page, then the cached ones; never page 1
    with pytest.raises(MemoryError):
        pm.allocate(1)
    assert pm.match_prefix(hashes) == [] and pm.match_prefix(hashes[1:2]) == [1]
    pm.unpin([1])
    assert pm.allocate(1) == [1]


def test_unpin_makes_a_cached_page_the_most_recently_freed():
    pm = PageManager(3, PS)
    assert pm.allocate(3) == [0, 1, 2]
    published(pm, [0, 1, 2])
    pm.pin([0])
    pm.release([0, 1, 2])  # cached: 2, 1
    pm.unpin([0])  # cached: 2, 1, 0
    assert pm.allocate(1) == [2]
    assert pm.allocate(1) == [1]
    assert pm.allocate(1) == [0]


def test_pinned_free_page_is_not_allocatable_until_unpinned():
    pm = PageManager(3, PS)
    pm.pin([0])  # ref count 0, yet a copy reads it
    assert (pm.is_free(0), pm.num_free) == (False, 2)
    assert pm.allocate(2) == [1, 2]
    with pytest.raises(MemoryError, match="need 1 pages, 0 free"):
        pm.allocate(1)
    pm.unpin([0])
    assert (pm.is_free(0), pm.num_free) == (True, 1)
    assert pm.allocate(1) == [0]
    assert pm.num_free == 0


def test_blocked_pages_are_skipped_and_not_counted_until_unblocked():
    blocked = {0, 1}
    pm = PageManager(6, PS, blocked=lambda: blocked)
    assert pm.num_free == 4
    assert pm.allocate(2) == [2, 3]
    blocked.add(2)  # a blocked page in use is not subtracted twice
    assert pm.num_free == 2
    with pytest.raises(MemoryError, match="need 3 pages, 2 free"):
        pm.allocate(3)
    assert pm.num_free == 2
    blocked.clear()
    assert pm.num_free == 4
    assert pm.allocate(4) == [0, 1, 4, 5]


def test_blocked_cached_page_is_neither_evicted_nor_counted():
    blocked: set[int] = set()
    pm = PageManager(3, PS, blocked=lambda: blocked)
    assert pm.allocate(3) == [0, 1, 2]
    hashes = published(pm, [0, 1, 2])
    pm.release([0, 1, 2])  # cached: 2, 1, 0
    blocked.add(2)
    assert pm.num_free == 2
    assert pm.allocate(1) == [1]  # the oldest cached page is blocked: the next one goes
    assert pm.match_prefix(hashes[2:]) == [2]
    blocked.clear()
    assert pm.num_free == 2
    assert pm.allocate(1) == [2]
    assert pm.allocate(1) == [0]


def test_on_allocate_receives_exactly_the_pages_of_each_allocation():
    log: list[list[int]] = []
    pm = PageManager(4, PS, on_allocate=log.append)
    assert pm.allocate(2) == [0, 1]
    published(pm, [0, 1])
    pm.release([0, 1])  # cached: 1, 0
    assert log == [[0, 1]]
    pm.acquire([0])  # a prefix hit is not an allocation
    assert log == [[0, 1]]
    assert pm.allocate(3) == [2, 3, 1]
    with pytest.raises(MemoryError):
        pm.allocate(1)
    assert pm.allocate(0) == []
    assert log == [[0, 1], [2, 3, 1], []]


# ---- hash chains -----------------------------------------------------------------------------------


def test_extend_chain_is_incremental_and_equals_a_chain_from_scratch():
    pm = PageManager(8, PS)
    tokens = [5, 3, 9, 1, 4, 4, 8, 2, 7, 6]
    chain: list[int] = []
    assert pm.extend_chain(chain, tokens[:3]) == []  # no full page yet
    assert pm.extend_chain(chain, tokens[:5]) is chain
    assert chain == [page_hash(ROOT_HASH, tokens[0:4], PS)]
    first = chain[0]
    pm.extend_chain(chain, tokens)
    assert chain == [first, page_hash(first, tokens[4:8], PS)]
    assert chain == pm.extend_chain([], tokens)


def test_page_hash_depends_on_every_token_the_parent_and_the_page_size():
    tokens = [11, 12, 13, 14]
    base = page_hash(ROOT_HASH, tokens, 4)
    for i in range(4):
        changed = list(tokens)
        changed[i] += 1
        assert page_hash(ROOT_HASH, changed, 4) != base, f"token {i} is not hashed"
    assert page_hash(ROOT_HASH, [12, 11, 13, 14], 4) != base
    assert page_hash(1, tokens, 4) != base
    assert page_hash(ROOT_HASH, tokens, 8) != base
    assert page_hash(ROOT_HASH, list(tokens), 4) == base


def test_chain_hash_covers_the_whole_prefix():
    pm = PageManager(4, PS)
    shared_tail = [9, 9, 9, 9]
    a = pm.extend_chain([], [1, 2, 3, 4] + shared_tail)
    b = pm.extend_chain([], [1, 2, 3, 5] + shared_tail)
    assert a[1] != b[1]  # same second page, different first page
    pages = pm.allocate(2)
    for p, h in zip(pages, a):
        pm.publish(p, h)
    assert pm.match_prefix(b) == []  # b's second page must not hit a's


def test_page_hash_is_stable_across_processes():
    code = "from talaria.memory.page_manager import page_hash; print(page_hash(123, [1, 2, 300000], 4))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout) == page_hash(123, [1, 2, 300000], 4)


def test_all_clean_is_free_and_caching_nothing_for_every_page_of_the_range():
    """The stager's range check agrees with the per-page definition through allocation, publishing,
    pinning and release."""
    pm = PageManager(12, 4)

    def check():
        for a in range(12):
            for b in range(a, 13):
                expected = all(pm.is_free(p) and not pm.is_cached(p) for p in range(a, b))
                assert pm.all_clean(range(a, b)) is expected, (a, b)

    check()
    pages = pm.allocate(5)  # 0-4 referenced
    check()
    pm.publish(pages[1], page_hash(ROOT_HASH, [1, 2, 3, 4], 4))
    pm.pin([pages[3]])
    pm.release(pages)  # 1 stays cached, 3 stays pinned
    check()
    assert pm.all_clean(range(5, 12)) and not pm.all_clean(range(1, 2)) and not pm.all_clean(range(3, 4))
    pm.unpin([pages[3]])
    check()


# ---- state slots and snapshots (a stateful layout) ----------------------------------------------


def test_a_stateful_pool_resumes_only_at_a_snapshot_and_evicts_snapshots_least_recently_used():
    from talaria.contracts.kv_layout import CacheTensor, KVLayout

    layout = KVLayout(PS, (CacheTensor("k", (0,), (1, 2), "float32", True),
                           CacheTensor("conv", (1,), (3, 4), "float32", False)))
    pm = PageManager(8, PS, layout=layout, state_slots=3)
    hashes = published(pm, pm.allocate(4))  # pages 0..3 cached under 1000..1003
    assert pm.resume_prefix(hashes) == []  # no snapshot: nothing to resume from, whatever is cached
    live = pm.take_state()
    assert (live, pm.publish_snapshot(1001), pm.publish_snapshot(1003)) == (0, 1, 2)
    assert pm.publish_snapshot(1003) is None  # already published: no second copy
    assert pm.resume_prefix(hashes) == [0, 1, 2, 3] and pm.resume_prefix(hashes[:3]) == [0, 1]
    pm.pin_state(1)  # a copy reads the snapshot after page 1: it is not evicted
    assert pm.states_free == 1 and pm.publish_snapshot(1000) == 2  # evicts 1003's, the oldest unpinned
    assert (pm.snapshot(1003), pm.resume_prefix(hashes)) == (None, [0, 1])
    assert (pm.publish_snapshot(1002), pm.snapshot(1000)) == (2, None)  # a newer one takes the LRU's slot
    pm.take_state()  # the last unpinned snapshot goes to a live state: none is left to take
    assert pm.states_free == 0 and pm.publish_snapshot(1003) is None and pm.snapshot(1002) is None
    pm.unpin_state(1)
    pm.free_state(live)
    assert pm.states_free == 2 and pm.take_state() == 0  # a free slot before any snapshot is evicted
