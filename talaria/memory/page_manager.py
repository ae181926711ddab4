"""KV pages and the prefix cache of one model, as ints, ref counts and hash chains.

Pages are fixed-size runs of token slots in the model's KV pool. A full page whose KV has been
computed is published under its cumulative prefix hash, which covers the page size and every token
from the start of the sequence to the end of that page; a later prompt that starts with the same
tokens reuses those pages instead of recomputing them. A dict keyed by cumulative hash is a radix
tree at page granularity: a hit on page i implies a hit on pages 0..i-1.

Freed pages keep their published hash and sit in an LRU list: they are evicted only when no clean
page is left, so a finished session's KV stays reusable as long as memory allows.

A model whose cache keeps a per-sequence state (`KVLayout.stateful`) also has state slots: each
running sequence holds a live one, and a snapshot of a live state taken at a page boundary is
published under the hash of the page it follows. A prefix is resumable only up to a published
snapshot (`resume_prefix`, the layout's rule); unreferenced snapshots are evicted least recently
used first when a slot is needed.
No tensors here: the runner owns the KV tensors, this class only decides which page ids to use.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from collections.abc import Set as AbstractSet
from itertools import islice

from talaria.contracts.kv_layout import KVLayout


def page_hash(parent: int, tokens: Seq[int], page_size: int) -> int:
    """Cumulative hash of a full page: stable across processes and Python runs."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little", signed=False))
    h.update(page_size.to_bytes(4, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


ROOT_HASH = 0


def chain_root(salt: str | None) -> int:
    """Where a call's page-hash chain starts: ROOT_HASH, or one of its own for a salted call (a
    tenant, a `cache_salt`), so that prefixes are shared only among calls of the same salt."""
    if not salt:
        return ROOT_HASH
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8, person=b"talaria-salt").digest(), "little")


class PageManager:
    """Pages of one model's KV pool: allocation, ref counts, DMA pins and the prefix cache.

    Allocation takes the lowest-numbered page that holds nothing cached, then evicts cached pages
    least recently freed first. Low pages first keeps the high-address tail of the pool free for
    staging the next model's weights (paper §4.4); `blocked` pages (a staging chunk being written)
    are never handed out, and `on_allocate` tells the stager which pages were taken.
    """

    def __init__(self, num_pages: int, page_size: int, blocked: Callable[[], AbstractSet[int]] | None = None,
                 on_allocate: Callable[[list[int]], None] | None = None, layout: KVLayout | None = None,
                 state_slots: int = 0) -> None:
        """`layout`: the model's cache (None: per-token only); `state_slots`: its state region's slots."""
        self.num_pages = num_pages
        self.page_size = page_size
        self.layout = layout
        self.stateful = layout is not None and layout.stateful
        self.num_state_slots = state_slots if self.stateful else 0
        self._slots_free = list(range(self.num_state_slots))  # a heap: neither live nor a snapshot
        self._snapshot_of: dict[int, int] = {}  # published hash -> snapshot slot
        self._hash_of_slot: dict[int, int] = {}  # snapshot slot -> its hash
        self._slot_pins = [0] * self.num_state_slots  # copies reading a snapshot (a load, a host save)
        # invariant: exactly the unpinned snapshots, least recently used first
        self._snapshots: OrderedDict[int, None] = OrderedDict()
        self.blocked = blocked or frozenset
        self.on_allocate = on_allocate
        self._ref = [0] * num_pages
        self._pins = [0] * num_pages  # DMA copies in flight (host saves): apart from radix references
        self._hash_of: list[int | None] = [None] * num_pages
        self._page_of: dict[int, int] = {}  # published hash -> page id
        # invariant: a page is free (clean or cached) iff its ref and pin counts are 0
        self._clean: list[int] = list(range(num_pages))  # heap of free pages caching nothing, lazily pruned
        self._is_clean = bytearray(b"\x01") * num_pages  # invariant: 1 iff the page is free and caches nothing
        self._n_clean = num_pages  # pages with _is_clean (the heap may also hold stale entries of others)
        self._cached: OrderedDict[int, None] = OrderedDict()  # free published pages, oldest first
        self.version = 0  # bumped by every change of which pages are free or cached (lets callers memoise scans)

    # ---- queries ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages that an allocation may take now (unreferenced, unpinned, not blocked)."""
        blocked = self.blocked()
        n = self._n_clean + len(self._cached)
        return n - sum(1 for p in blocked if self._is_free(p)) if blocked else n

    @property
    def num_used(self) -> int:
        return self.num_pages - self._n_clean - len(self._cached)

    def _is_free(self, page: int) -> bool:
        return self._ref[page] == 0 and self._pins[page] == 0

    def is_free(self, page: int) -> bool:
        """Unreferenced and unpinned (it may still cache a prefix)."""
        return self._is_free(page)

    def all_clean(self, pages: range) -> bool:
        """Every page of the range is free and caches nothing (one C-level scan: the stager asks
        this of its chunks' page ranges at every step)."""
        return 0 not in self._is_clean[pages.start:pages.stop]

    def is_cached(self, page: int) -> bool:
        """The page holds a published prefix (whether or not anyone references it)."""
        return self._hash_of[page] is not None

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def extend_chain(self, chain: list[int], tokens: Seq[int], root: int = ROOT_HASH) -> list[int]:
        """Extend `chain` in place to the cumulative hashes of every full page of `tokens`; an empty
        chain starts from `root` (`chain_root`)."""
        ps = self.page_size
        for i in range(len(chain), len(tokens) // ps):
            chain.append(page_hash(chain[-1] if chain else root, tokens[i * ps:(i + 1) * ps], ps))
        return chain

    def match_prefix(self, chain: Seq[int]) -> list[int]:
        """Pages holding the longest cached prefix whose cumulative page hashes are `chain`."""
        pages: list[int] = []
        for h in chain:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def resume_prefix(self, chain: Seq[int]) -> list[int]:
        """Pages of the longest cached prefix of `chain` a sequence may resume from (the layout's
        resume rule: any page without state, else only up to a published snapshot)."""
        pages = self.match_prefix(chain)
        if not self.stateful:
            return pages
        return pages[:self.layout.resume_pages(len(pages), lambda n: chain[n - 1] in self._snapshot_of)]

    # ---- state slots (stateful layouts) ------------------------------------------------------

    def snapshot(self, h: int) -> int | None:
        """The slot of the published snapshot after the page whose cumulative hash is `h`."""
        return self._snapshot_of.get(h)

    @property
    def states_free(self) -> int:
        """State slots a live state could take now (free, or an unpinned snapshot to evict)."""
        return len(self._slots_free) + len(self._snapshots)

    def _take_slot(self) -> int | None:
        if self._slots_free:
            return heapq.heappop(self._slots_free)
        if not self._snapshots:
            return None
        slot, _ = self._snapshots.popitem(last=False)  # the least recently used snapshot
        del self._snapshot_of[self._hash_of_slot.pop(slot)]
        return slot

    def take_state(self) -> int:
        """A live state slot for a sequence being admitted; caller checks `states_free`."""
        slot = self._take_slot()
        if slot is None:
            raise MemoryError("state slots exhausted: every slot is live or a snapshot being copied")
        return slot

    def free_state(self, slot: int) -> None:
        """A live state slot back to the pool."""
        heapq.heappush(self._slots_free, slot)

    def publish_snapshot(self, h: int) -> int | None:
        """A slot for the snapshot after the page hashed `h`, published now (the copy into it rides
        the next step, before any other use of the slot); None when `h` has one already or no slot
        is free (the prefix then resumes from an earlier snapshot)."""
        if h in self._snapshot_of:
            slot = self._snapshot_of[h]
            if slot in self._snapshots:
                self._snapshots.move_to_end(slot)
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        self._snapshot_of[h], self._hash_of_slot[slot] = slot, h
        self._snapshots[slot] = None
        return slot

    def pin_state(self, slot: int) -> None:
        """A copy reads this snapshot: keep it from eviction until `unpin_state`."""
        self._snapshots.pop(slot, None)
        self._slot_pins[slot] += 1

    def unpin_state(self, slot: int) -> None:
        self._slot_pins[slot] -= 1
        if self._slot_pins[slot] == 0 and slot in self._hash_of_slot:
            self._snapshots[slot] = None

    # ---- mutations -------------------------------------------------------------------------

    def acquire(self, pages: Seq[int]) -> None:
        """Take a reference on cached pages (a prefix hit)."""
        self.version += 1
        for p in pages:
            if self._is_free(p):
                del self._cached[p]  # a hit is always on a published page
            self._ref[p] += 1

    def allocate(self, n: int) -> list[int]:
        """n fresh pages: lowest clean pages first, then evict cached ones; caller checks num_free."""
        self.version += 1
        blocked = self.blocked()
        clean, skipped = [], []
        while len(clean) < n and self._clean:
            p = heapq.heappop(self._clean)
            if not self._is_clean[p]:
                continue  # a stale entry: the page was pinned or published since it was pushed
            (skipped if p in blocked else clean).append(p)
        evict = []
        if len(clean) < n:
            # the oldest cached pages, taken lazily: the pool may cache tens of thousands
            evict = list(islice((p for p in self._cached if p not in blocked), n - len(clean)))
        for p in clean + skipped if len(clean) + len(evict) < n else skipped:
            heapq.heappush(self._clean, p)  # put back what is not taken
        if len(clean) + len(evict) < n:  # decide before touching anything: a failure changes nothing
            raise MemoryError(f"KV pool exhausted: need {n} pages, {len(clean) + len(evict)} free")
        for p in clean:
            self._is_clean[p] = False
        self._n_clean -= len(clean)
        for p in evict:
            del self._cached[p]
            self._unpublish(p)
        out = clean + evict
        for p in out:
            self._ref[p] = 1
        if self.on_allocate is not None:
            self.on_allocate(out)
        return out

    def release(self, pages: Seq[int]) -> None:
        """Drop one reference per page; unreferenced pages stay cached until evicted."""
        self.version += 1
        for p in reversed(pages):  # the tail is evicted first: it is the least shareable
            self._ref[p] -= 1
            if self._is_free(p):
                self._free(p)

    def pin(self, pages: Seq[int]) -> None:
        """A copy reads these pages (a host save): keep them from reuse until `unpin`."""
        self.version += 1
        for p in pages:
            if self._is_free(p):  # take it off the free structures while the copy runs
                if p in self._cached:
                    del self._cached[p]
                else:
                    self._is_clean[p] = False  # its heap entry goes stale
                    self._n_clean -= 1
            self._pins[p] += 1

    def unpin(self, pages: Seq[int]) -> None:
        self.version += 1
        for p in reversed(pages):
            self._pins[p] -= 1
            if self._is_free(p):
                self._free(p)

    def _free(self, page: int) -> None:
        if self._hash_of[page] is None:
            heapq.heappush(self._clean, page)
            self._is_clean[page] = True
            self._n_clean += 1
            if len(self._clean) > 2 * self._n_clean + 1024:  # too many stale entries: rebuild
                self._clean = [p for p in range(self.num_pages) if self._is_clean[p]]
        else:
            self._cached[page] = None

    def _unpublish(self, page: int) -> None:
        h = self._hash_of[page]
        if h is not None:
            self._hash_of[page] = None
            if self._page_of.get(h) == page:
                del self._page_of[h]

    def publish(self, page: int, h: int) -> None:
        """Make a computed full page findable by its cumulative hash."""
        self.version += 1
        if self._hash_of[page] is not None:
            return
        if h in self._page_of:  # the same content is already cached in another page
            return
        self._hash_of[page] = h
        self._page_of[h] = page
