"""The host KV registry (HKVR): which host slab holds which model's KV page, as ints and hashes.

Switching away from a model reclaims its device KV, but a session returning after a tool gap still
wants the prefix it built. HKVR keeps such prefixes in one pool of fixed-size host slabs shared by
every model of the instance (paper §4.3): one slab per page, keyed by (model, cumulative page
hash), so a dict of keys is a radix tree at page granularity per model and models never collide.

A model whose cache keeps a per-sequence state (`KVLayout.stateful`) also saves state snapshots: an
entry typed STATE, keyed by the hash of the page it follows, in a second pool of slabs sized for the
largest state (App. C: "Mamba-style paths register recurrent and auxiliary state"). Such a prefix
is restorable only up to a published state (`KVLayout.resume_pages`), and a state is published only
at or below the agreed page, like the pages it follows.

A save (device→host) is asynchronous, so it is two-phase: `begin_save` reserves slabs and pins
them while the DMA runs; `finish_save` publishes only the pages every TP rank agreed on (see
`agreed_pages`) and frees the rest. Only published entries are matchable, so a restore never reads
a half-written slab (App. B, "Lifetime separation" and "Prefix agreement"). DMA pins are counted
apart from publication: a pinned slab is never evicted; unpinned published entries are evicted
least recently used first. No tensors here: the engine copies the bytes into the slabs named here.

With HKVR ablated the registry still swaps: a sequence preempted while running (at a slot's close, or
on KV pressure) is saved here and restored when it resumes, as the round scheduler's own state (paper
§3.4: "a sequence that remains active throughout the round", Eq. (4)). Only HKVR's keeping of a
finished call's prefix for its session's return is off then (`sessions` False): see the Batcher.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from talaria.contracts.kv_layout import KVLayout
from talaria.contracts.vocabulary import KVLocation
from talaria.memory.bump_layout import LayoutPlan


class Kind(Enum):
    PAGE = "page"  # one page of per-token cache tensors
    STATE = "state"  # a per-sequence state snapshot, after the page its hash names

    # members are singletons compared by identity: hash them so too, in C (Enum's own __hash__ is a
    # Python call, and every registry key holds a Kind: 4.4M hashes in one simulated replay)
    __hash__ = object.__hash__


Key = tuple[str, int, Kind]  # (model, cumulative page hash, kind)


@dataclass(frozen=True, slots=True)
class SlabPools:
    """How one rank's host KV budget splits into page slabs and state slabs, each sized for the
    largest model's page or state. Without state, every byte is page slabs. With it, the host keeps
    states and pages in the proportion the device arena does for the stateful model that gives
    states the most (its state region against its page pool): what the device held of a sequence,
    the host can hold after it."""

    pages: int  # page slabs
    page_bytes: int  # bytes of one page slab
    states: int = 0  # state slabs
    state_bytes: int = 0  # bytes of one state slab

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes + self.states * self.state_bytes

    @classmethod
    def of(cls, budget: int, plans: Sequence[LayoutPlan]) -> SlabPools:
        """The pools for `budget` bytes and the arena layout of every model served."""
        page_bytes = max(p.page_bytes for p in plans)
        state_bytes = max(p.state_bytes for p in plans)
        if not state_bytes:
            return cls(budget // page_bytes, page_bytes)
        share = max(p.states.size / (p.states.size + p.num_pages * p.page_bytes) for p in plans if p.state_bytes)
        states = int(budget * share) // state_bytes
        return cls((budget - states * state_bytes) // page_bytes, page_bytes, states, state_bytes)


@dataclass(slots=True)
class _Pool:
    """The slabs of one size class: ids 0..num-1, each free, in flight or published."""

    num: int
    slab_bytes: int
    free: list[int] = field(init=False)  # a heap: the lowest free slab id goes first
    key_of: list[Key | None] = field(init=False)
    published: list[bool] = field(init=False)
    pins: list[int] = field(init=False)
    # invariant: lru holds exactly the published entries with no pin, oldest first
    lru: OrderedDict[Key, None] = field(init=False)

    def __post_init__(self) -> None:
        self.free, self.key_of = list(range(self.num)), [None] * self.num
        self.published, self.pins, self.lru = [False] * self.num, [0] * self.num, OrderedDict()


@dataclass(frozen=True, slots=True)
class SaveEntry:
    """One page of a save: copy the device page at `page_index` of the chain into `slab`."""

    page_index: int  # position of the page in the chain passed to begin_save (a state: of the page it follows)
    hash: int  # cumulative page hash: the entry's key within its model
    slab: int  # host slab reserved (and pinned) for the copy, in its kind's pool
    kind: Kind = Kind.PAGE


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
    used: int  # page slabs holding an entry, published or in flight
    pinned: int  # slabs with at least one DMA pin (save or restore in flight)
    published: int  # matchable entries
    in_flight: int  # entries reserved by a save that has not finished
    hits: int  # pages returned by match, over the registry's life
    saves: int  # pages published by finish_save
    evictions: int  # published entries dropped to make room
    num_state_slabs: int = 0  # the state pool's slabs (0: no model keeps state)
    states_used: int = 0  # state slabs holding an entry, published or in flight


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
    """Host slabs for the KV pages (and state snapshots) of all models of one instance: reserve,
    publish, match, evict."""

    def __init__(self, num_slabs: int, slab_bytes: int, state_slabs: int = 0, state_bytes: int = 0,
                 layouts: Mapping[str, KVLayout] | None = None, sessions: bool = True) -> None:
        """`layouts`: each model's cache layout, whose resume rule `resumable` applies (a model left
        out resumes at any page); state snapshots go to `state_slabs` slabs of `state_bytes`.
        `sessions`: HKVR proper, a finished call's prefix is kept for its session's next call; False
        (HKVR ablated): only sequences preempted in flight are swapped here, each restoring its own."""
        if num_slabs <= 0 or slab_bytes <= 0 or state_slabs < 0 or (state_slabs and state_bytes <= 0):
            raise ValueError(f"host KV registry needs positive sizes, got {num_slabs} slabs "
                             f"of {slab_bytes} bytes and {state_slabs} state slabs of {state_bytes} bytes")
        self.num_slabs = num_slabs
        self.slab_bytes = slab_bytes
        self.layouts = dict(layouts or {})
        self.sessions = sessions
        self._pools = {Kind.PAGE: _Pool(num_slabs, slab_bytes), Kind.STATE: _Pool(state_slabs, state_bytes)}
        self._slab_of: dict[Key, int] = {}  # every entry, published or in flight
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
        return sum(p.num * p.slab_bytes for p in self._pools.values())

    # ---- queries -------------------------------------------------------------------------------

    def _matched(self, model: str, chain: Sequence[int]) -> list[int]:
        slabs: list[int] = []
        pool = self._pools[Kind.PAGE]
        for h in chain:
            slab = self._slab_of.get((model, h, Kind.PAGE))
            if slab is None or not pool.published[slab]:  # in flight: not readable yet
                break
            slabs.append(slab)
        return slabs

    def state(self, model: str, h: int) -> int | None:
        """The state slab of the published snapshot after the page whose cumulative hash is `h`."""
        slab = self._slab_of.get((model, h, Kind.STATE))
        return slab if slab is not None and self._pools[Kind.STATE].published[slab] else None

    def resumable(self, model: str, chain: Sequence[int]) -> int:
        """Leading pages of `chain` a sequence could resume from with this registry alone (the
        resume rule over its published pages and states); no side effects."""
        n = len(self._matched(model, chain))
        layout = self.layouts.get(model)
        return layout.resume_pages(n, lambda k: self.state(model, chain[k - 1]) is not None) if layout else n

    def match(self, model: str, chain: Sequence[int]) -> list[int]:
        """Slabs of the longest published prefix of `chain`, in page order; refreshes recency.

        The caller pins the slabs (`pin`) before issuing the host→device copy, and cuts `chain`
        to where the resume rule lets it resume (`resumable`, or device pages and states too).
        """
        slabs = self._matched(model, chain)
        self._touch([(model, h, Kind.PAGE) for h in chain[: len(slabs)]])
        self._hits += len(slabs)
        return slabs

    def peek(self, model: str, chain: Sequence[int]) -> list[int]:
        """Like `match`, without refreshing recency or counting hits (telemetry)."""
        return self._matched(model, chain)

    def location(self, model: str, chain: Sequence[int], min_pages: int = 1) -> KVLocation:
        """HOST if at least `min_pages` leading pages of `chain` are restorable, else MISSING."""
        if min_pages < 1:
            raise ValueError(f"min_pages must be at least 1, got {min_pages}")
        return KVLocation.HOST if self.resumable(model, chain) >= min_pages else KVLocation.MISSING

    def pending(self, model: str) -> tuple[SaveTicket, ...]:
        """Saves of `model` still in flight: what a switch away from it must drain first."""
        return tuple(t for t in self._tickets.values() if t.model == model)

    def ticket(self, ticket_id: int) -> SaveTicket:
        """The in-flight ticket with this id (plans carry ids across processes)."""
        return self._tickets[ticket_id]

    def stats(self) -> RegistryStats:
        pages, states = self._pools[Kind.PAGE], self._pools[Kind.STATE]
        return RegistryStats(
            num_slabs=self.num_slabs, used=pages.num - len(pages.free), pinned=self._num_pinned,
            published=self._num_published, in_flight=self._num_in_flight,
            hits=self._hits, saves=self._saves, evictions=self._evictions,
            num_state_slabs=states.num, states_used=states.num - len(states.free))

    # ---- saves ---------------------------------------------------------------------------------

    def begin_save(self, model: str, chain: Sequence[int], state_after: int = 0) -> SaveTicket | None:
        """Reserve and pin slabs for the pages of `chain` not yet present (published or in flight),
        and with `state_after` > 0 for the state snapshot after its first `state_after` pages.

        Free slabs go first (lowest id), then least recently used unpinned published entries are
        evicted. When the pool cannot hold every absent page, the leading absent pages that fit are
        reserved: a page saved without its head is useless, and so is a state without its pages
        (it is reserved only when every page before it is present). None if nothing is reserved.
        """
        keys = [(model, h, Kind.PAGE) for h in chain]
        if state_after:
            keys.append((model, chain[state_after - 1], Kind.STATE))
        # the chain's own published entries must not be evicted to make room for its tail
        protected = [k for k in dict.fromkeys(keys) if k in self._pools[k[2]].lru]
        for k in protected:
            del self._pools[k[2]].lru[k]
        entries: list[SaveEntry] = []
        full = False  # a page found no room: nothing after it is reserved
        for i, key in enumerate(keys):
            if key in self._slab_of:
                continue
            kind = key[2]
            pool = self._pools[kind]
            index = i if kind is Kind.PAGE else state_after - 1
            if full or not (pool.free or pool.lru) or \
                    (kind is Kind.STATE and not all(k in self._slab_of for k in keys[:state_after])):
                full = True
                continue
            slab = heapq.heappop(pool.free) if pool.free else self._evict_one(pool)
            self._slab_of[key] = slab
            pool.key_of[slab] = key
            self._pin_one(pool, slab)  # invariant: an in-flight slab carries the save's pin
            entries.append(SaveEntry(page_index=index, hash=key[1], slab=slab, kind=kind))
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
        hold data some rank does not vouch for, so they are never exposed, nor is a state after them.
        """
        if agreed_pages < 0:
            raise ValueError(f"agreed_pages must be >= 0, got {agreed_pages}")
        self._take_ticket(ticket)
        published: list[Key] = []
        for e in ticket.entries:
            pool = self._pools[e.kind]
            if e.page_index < agreed_pages:
                pool.published[e.slab] = True
                published.append((ticket.model, e.hash, e.kind))
            self._unpin_one(pool, e.slab)
            if e.page_index >= agreed_pages:
                self._drop(pool, e.slab)
        self._num_published += len(published)
        self._saves += len(published)
        self._touch(published)

    def abort_save(self, ticket: SaveTicket) -> None:
        """The copy failed or was cancelled: free every slab of the ticket."""
        self._take_ticket(ticket)
        for e in ticket.entries:
            pool = self._pools[e.kind]
            self._unpin_one(pool, e.slab)
            self._drop(pool, e.slab)

    # ---- restore pins --------------------------------------------------------------------------

    def pin(self, slabs: Sequence[int], kind: Kind = Kind.PAGE) -> None:
        """Pin published slabs while a host→device restore reads them (counted, may nest)."""
        pool = self._pools[kind]
        for s in slabs:
            if not pool.published[s]:
                raise ValueError(f"{kind.value} slab {s} holds no published entry; pin only slabs from "
                                 "match() or state()")
        for s in slabs:
            self._pin_one(pool, s)

    def unpin(self, slabs: Sequence[int], kind: Kind = Kind.PAGE) -> None:
        """Drop one restore pin per slab; an unpinned entry becomes the most recently used."""
        pool = self._pools[kind]
        for s in slabs:
            if pool.pins[s] == 0 or not pool.published[s]:
                raise ValueError(f"{kind.value} slab {s} is not pinned by a restore; unpin what pin() pinned")
        for s in slabs:
            self._unpin_one(pool, s)

    # ---- internals -----------------------------------------------------------------------------

    def _touch(self, keys: Sequence[Key]) -> None:
        """Make unpinned published `keys` (page order) the most recent, head pages last.

        Deeper pages are left older, so eviction trims a prefix from its tail, never its head.
        """
        for k in reversed(keys):
            pool = self._pools[k[2]]
            slab = self._slab_of[k]
            if pool.published[slab] and pool.pins[slab] == 0:
                pool.lru[k] = None
                pool.lru.move_to_end(k)

    def _pin_one(self, pool: _Pool, slab: int) -> None:
        if pool.pins[slab] == 0:
            self._num_pinned += 1
            pool.lru.pop(pool.key_of[slab], None)  # type: ignore[arg-type]
        pool.pins[slab] += 1

    def _unpin_one(self, pool: _Pool, slab: int) -> None:
        pool.pins[slab] -= 1
        if pool.pins[slab] == 0:
            self._num_pinned -= 1
            key = pool.key_of[slab]
            if key is not None and pool.published[slab]:
                pool.lru[key] = None

    def _evict_one(self, pool: _Pool) -> int:
        # invariant: a pinned slab is never reused, whatever the LRU says (it is not in lru)
        key, _ = pool.lru.popitem(last=False)
        slab = self._slab_of.pop(key)
        pool.key_of[slab] = None
        pool.published[slab] = False
        self._num_published -= 1
        self._evictions += 1
        return slab

    def _drop(self, pool: _Pool, slab: int) -> None:
        """Forget an unpublished, unpinned entry and return its slab to the free pool."""
        del self._slab_of[pool.key_of[slab]]  # type: ignore[arg-type]
        pool.key_of[slab] = None
        heapq.heappush(pool.free, slab)

    def _take_ticket(self, ticket: SaveTicket) -> None:
        if self._tickets.get(ticket.ticket_id) != ticket:
            raise ValueError(f"save ticket {ticket.ticket_id} of model {ticket.model!r} is unknown "
                             "or already finished; finish or abort each ticket exactly once")
        del self._tickets[ticket.ticket_id]
        self._num_in_flight -= len(ticket.entries)
