"""The host KV registry (HKVR): which host slab holds which model's KV page, as ints and hashes.

Switching away from a model reclaims its device KV, but a session returning after a tool gap still
wants the prefix it built. HKVR keeps such prefixes in one pool of fixed-size host slabs shared by
every model of the instance (paper §4.3): one slab per page, keyed by (model, cumulative page
hash), so a dict of keys is a radix tree at page granularity per model and models never collide.

A save (device→host) is asynchronous, so it is two-phase: `begin_save` reserves slabs and pins
them while the DMA runs; `finish_save` publishes only the pages every TP rank agreed on (see
`agreed_pages`) and frees the rest. Only published entries are matchable, so a restore never reads
a half-written slab (App. B, "Lifetime separation" and "Prefix agreement"). DMA pins are counted
apart from publication: a pinned slab is never evicted; unpinned published entries are evicted
least recently used first. No tensors here: the engine copies the bytes into the slabs named here.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from talaria.contracts.vocabulary import KVLocation

Key = tuple[str, int]  # (model, cumulative page hash)


@dataclass(frozen=True, slots=True)
class SaveEntry:
    """One page of a save: copy the device page at `page_index` of the chain into `slab`."""

    page_index: int  # position of the page in the chain passed to begin_save
    hash: int  # cumulative page hash: the entry's key within its model
    slab: int  # host slab reserved (and pinned) for the copy


@dataclass(frozen=True, slots=True)
class SaveTicket:
    """A reservation for one asynchronous device→host copy, handed back to finish/abort_save."""

    ticket_id: int  # unique within one registry
    model: str
    entries: tuple[SaveEntry, ...]  # in chain order, page indices increasing


@dataclass(frozen=True, slots=True)
class RankReport:
    """What one tensor-parallel rank says it holds for a sequence."""

    committed_tokens: int  # tokens whose KV this rank has computed and committed
    chain: tuple[int, ...]  # the rank's cumulative page hashes, page order


@dataclass(frozen=True, slots=True)
class RegistryStats:
    """A snapshot of the registry's occupancy and counters."""

    num_slabs: int
    used: int  # slabs holding an entry, published or in flight
    pinned: int  # slabs with at least one DMA pin (save or restore in flight)
    published: int  # matchable entries
    in_flight: int  # entries reserved by a save that has not finished
    hits: int  # pages returned by match, over the registry's life
    saves: int  # pages published by finish_save
    evictions: int  # published entries dropped to make room


def agreed_pages(reports: Sequence[RankReport], page_size: int) -> int:
    """Leading pages on which every TP rank agrees: the only part a save may publish.

    A rank that lags (fewer committed tokens or a shorter chain) or whose hash differs cuts the
    agreement short; the rest is recomputed later, so disagreement costs reuse, never correctness.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if not reports:
        raise ValueError("agreed_pages needs at least one rank report")
    n = min(min(r.committed_tokens // page_size, len(r.chain)) for r in reports)
    first = reports[0].chain
    for i in range(max(n, 0)):
        if any(r.chain[i] != first[i] for r in reports):
            return i
    return max(n, 0)


class HostKVRegistry:
    """Host slabs for the KV pages of all models of one instance: reserve, publish, match, evict."""

    def __init__(self, num_slabs: int, slab_bytes: int) -> None:
        if num_slabs <= 0 or slab_bytes <= 0:
            raise ValueError(f"host KV registry needs positive sizes, got {num_slabs} slabs "
                             f"of {slab_bytes} bytes")
        self.num_slabs = num_slabs
        self.slab_bytes = slab_bytes
        self._free = list(range(num_slabs))  # a heap: the lowest free slab id goes first
        self._slab_of: dict[Key, int] = {}  # every entry, published or in flight
        self._key_of: list[Key | None] = [None] * num_slabs
        self._published = [False] * num_slabs
        self._pins = [0] * num_slabs
        # invariant: _lru holds exactly the published entries with no pin, oldest first
        self._lru: OrderedDict[Key, None] = OrderedDict()
        self._tickets: dict[int, SaveTicket] = {}
        self._next_ticket = 0
        self._num_published = self._num_in_flight = self._num_pinned = 0
        self._hits = self._saves = self._evictions = 0

    @classmethod
    def from_budget(cls, budget_bytes: int, slab_bytes: int) -> HostKVRegistry:
        """As many slabs of `slab_bytes` as fit in `budget_bytes`."""
        return cls(budget_bytes // slab_bytes if slab_bytes > 0 else 0, slab_bytes)

    @property
    def budget_bytes(self) -> int:
        return self.num_slabs * self.slab_bytes

    # ---- queries -------------------------------------------------------------------------------

    def _matched(self, model: str, chain: Sequence[int]) -> list[int]:
        slabs: list[int] = []
        for h in chain:
            slab = self._slab_of.get((model, h))
            if slab is None or not self._published[slab]:  # in flight: not readable yet
                break
            slabs.append(slab)
        return slabs

    def match(self, model: str, chain: Sequence[int]) -> list[int]:
        """Slabs of the longest published prefix of `chain`, in page order; refreshes recency.

        The caller pins the slabs (`pin`) before issuing the host→device copy.
        """
        slabs = self._matched(model, chain)
        self._touch([(model, h) for h in chain[: len(slabs)]])
        self._hits += len(slabs)
        return slabs

    def peek(self, model: str, chain: Sequence[int]) -> list[int]:
        """Like `match`, without refreshing recency or counting hits (telemetry)."""
        return self._matched(model, chain)

    def location(self, model: str, chain: Sequence[int], min_pages: int = 1) -> KVLocation:
        """HOST if at least `min_pages` leading pages of `chain` are restorable, else MISSING."""
        if min_pages < 1:
            raise ValueError(f"min_pages must be at least 1, got {min_pages}")
        ok = len(self._matched(model, chain[:min_pages])) == min_pages
        return KVLocation.HOST if ok else KVLocation.MISSING

    def pending(self, model: str) -> tuple[SaveTicket, ...]:
        """Saves of `model` still in flight: what a switch away from it must drain first."""
        return tuple(t for t in self._tickets.values() if t.model == model)

    def ticket(self, ticket_id: int) -> SaveTicket:
        """The in-flight ticket with this id (plans carry ids across processes)."""
        return self._tickets[ticket_id]

    def stats(self) -> RegistryStats:
        return RegistryStats(
            num_slabs=self.num_slabs, used=len(self._slab_of), pinned=self._num_pinned,
            published=self._num_published, in_flight=self._num_in_flight,
            hits=self._hits, saves=self._saves, evictions=self._evictions)

    # ---- saves ---------------------------------------------------------------------------------

    def begin_save(self, model: str, chain: Sequence[int]) -> SaveTicket | None:
        """Reserve and pin slabs for the pages of `chain` not yet present (published or in flight).

        Free slabs go first (lowest id), then least recently used unpinned published entries are
        evicted. When the pool cannot hold every absent page, the leading absent pages that fit are
        reserved: a page saved without its head is useless. None if nothing is reserved.
        """
        # the chain's own published pages must not be evicted to make room for its tail
        protected = [k for k in dict.fromkeys((model, h) for h in chain) if k in self._lru]
        for k in protected:
            del self._lru[k]
        room = len(self._free) + len(self._lru)
        entries: list[SaveEntry] = []
        for i, h in enumerate(chain):
            key = (model, h)
            if key in self._slab_of:
                continue
            if len(entries) == room:
                break
            slab = heapq.heappop(self._free) if self._free else self._evict_one()
            self._slab_of[key] = slab
            self._key_of[slab] = key
            self._pin_one(slab)  # invariant: an in-flight slab carries the save's pin
            entries.append(SaveEntry(page_index=i, hash=h, slab=slab))
        self._touch(protected)  # saving a prefix again counts as using its pages
        if not entries:
            return None
        self._num_in_flight += len(entries)
        ticket = SaveTicket(ticket_id=self._next_ticket, model=model, entries=tuple(entries))
        self._next_ticket += 1
        self._tickets[ticket.ticket_id] = ticket
        return ticket

    def finish_save(self, ticket: SaveTicket, agreed_pages: int) -> None:
        """The copy is done: publish the entries with page_index < agreed_pages, free the rest.

        `agreed_pages` is the TP agreement (`agreed_pages(...)`) over the whole chain; pages past it
        hold data some rank does not vouch for, so they are never exposed.
        """
        if agreed_pages < 0:
            raise ValueError(f"agreed_pages must be >= 0, got {agreed_pages}")
        self._take_ticket(ticket)
        published: list[Key] = []
        for e in ticket.entries:
            if e.page_index < agreed_pages:
                self._published[e.slab] = True
                published.append((ticket.model, e.hash))
            self._unpin_one(e.slab)
            if e.page_index >= agreed_pages:
                self._drop(e.slab)
        self._num_published += len(published)
        self._saves += len(published)
        self._touch(published)

    def abort_save(self, ticket: SaveTicket) -> None:
        """The copy failed or was cancelled: free every slab of the ticket."""
        self._take_ticket(ticket)
        for e in ticket.entries:
            self._unpin_one(e.slab)
            self._drop(e.slab)

    # ---- restore pins --------------------------------------------------------------------------

    def pin(self, slabs: Sequence[int]) -> None:
        """Pin published slabs while a host→device restore reads them (counted, may nest)."""
        for s in slabs:
            if not self._published[s]:
                raise ValueError(f"slab {s} holds no published entry; pin only slabs from match()")
        for s in slabs:
            self._pin_one(s)

    def unpin(self, slabs: Sequence[int]) -> None:
        """Drop one restore pin per slab; an unpinned entry becomes the most recently used."""
        for s in slabs:
            if self._pins[s] == 0 or not self._published[s]:
                raise ValueError(f"slab {s} is not pinned by a restore; unpin what pin() pinned")
        for s in slabs:
            self._unpin_one(s)

    # ---- internals -----------------------------------------------------------------------------

    def _touch(self, keys: Sequence[Key]) -> None:
        """Make unpinned published `keys` (page order) the most recent, head pages last.

        Deeper pages are left older, so eviction trims a prefix from its tail, never its head.
        """
        for k in reversed(keys):
            slab = self._slab_of[k]
            if self._published[slab] and self._pins[slab] == 0:
                self._lru[k] = None
                self._lru.move_to_end(k)

    def _pin_one(self, slab: int) -> None:
        if self._pins[slab] == 0:
            self._num_pinned += 1
            self._lru.pop(self._key_of[slab], None)  # type: ignore[arg-type]
        self._pins[slab] += 1

    def _unpin_one(self, slab: int) -> None:
        self._pins[slab] -= 1
        if self._pins[slab] == 0:
            self._num_pinned -= 1
            key = self._key_of[slab]
            if key is not None and self._published[slab]:
                self._lru[key] = None

    def _evict_one(self) -> int:
        # invariant: a pinned slab is never reused, whatever the LRU says (it is not in _lru)
        key, _ = self._lru.popitem(last=False)
        slab = self._slab_of.pop(key)
        self._key_of[slab] = None
        self._published[slab] = False
        self._num_published -= 1
        self._evictions += 1
        return slab

    def _drop(self, slab: int) -> None:
        """Forget an unpublished, unpinned entry and return its slab to the free pool."""
        del self._slab_of[self._key_of[slab]]  # type: ignore[arg-type]
        self._key_of[slab] = None
        heapq.heappush(self._free, slab)

    def _take_ticket(self, ticket: SaveTicket) -> None:
        if self._tickets.get(ticket.ticket_id) != ticket:
            raise ValueError(f"save ticket {ticket.ticket_id} of model {ticket.model!r} is unknown "
                             "or already finished; finish or abort each ticket exactly once")
        del self._tickets[ticket.ticket_id]
        self._num_in_flight -= len(ticket.entries)
