"""KV pages and the prefix cache of one model, as ints, ref counts and hash chains.

Pages are fixed-size runs of token slots in the model's KV pool. A full page whose KV has been
computed is published under its cumulative prefix hash, which covers the page size and every token
from the start of the sequence to the end of that page; a later prompt that starts with the same
tokens reuses those pages instead of recomputing them. A dict keyed by cumulative hash is a radix
tree at page granularity: a hit on page i implies a hit on pages 0..i-1.

Freed pages keep their published hash and sit in an LRU list: they are evicted only when a new
allocation needs room, so a finished session's KV stays reusable as long as memory allows.
No tensors here: the runner owns the KV tensors, this class only decides which page ids to use.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq


def page_hash(parent: int, tokens: Seq[int], page_size: int) -> int:
    """Cumulative hash of a full page: stable across processes and Python runs."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little", signed=False))
    h.update(page_size.to_bytes(4, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


ROOT_HASH = 0


class PageManager:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self._ref = [0] * num_pages
        self._hash_of: list[int | None] = [None] * num_pages
        self._page_of: dict[int, int] = {}  # published hash -> page id
        # invariant: a page is in _free exactly when its ref count is 0; oldest first
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))

    # ---- queries ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages that an allocation may take (unreferenced, cached or not)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def is_free(self, page: int) -> bool:
        return self._ref[page] == 0

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def extend_chain(self, chain: list[int], tokens: Seq[int]) -> list[int]:
        """Extend `chain` in place to the cumulative hashes of every full page of `tokens`."""
        ps = self.page_size
        for i in range(len(chain), len(tokens) // ps):
            chain.append(page_hash(chain[-1] if chain else ROOT_HASH, tokens[i * ps:(i + 1) * ps], ps))
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

    # ---- mutations -------------------------------------------------------------------------

    def acquire(self, pages: Seq[int]) -> None:
        """Take a reference on cached pages (a prefix hit)."""
        for p in pages:
            if self._ref[p] == 0:
                del self._free[p]
            self._ref[p] += 1

    def allocate(self, n: int) -> list[int]:
        """n fresh pages, evicting least-recently freed cached pages; caller checks num_free."""
        if n > len(self._free):
            raise MemoryError(f"KV pool exhausted: need {n} pages, {len(self._free)} free")
        out = []
        for _ in range(n):
            p, _ = self._free.popitem(last=False)
            h = self._hash_of[p]
            if h is not None:  # evict from the prefix cache
                self._hash_of[p] = None
                if self._page_of.get(h) == p:
                    del self._page_of[h]
            self._ref[p] = 1
            out.append(p)
        return out

    def release(self, pages: Seq[int]) -> None:
        """Drop one reference per page; unreferenced pages stay cached until evicted."""
        for p in reversed(pages):  # the tail is evicted first: it is the least shareable
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free[p] = None

    def publish(self, page: int, h: int) -> None:
        """Make a computed full page findable by its cumulative hash."""
        if self._hash_of[page] is not None:
            return
        if h in self._page_of:  # the same content is already cached in another page
            return
        self._hash_of[page] = h
        self._page_of[h] = page

    def reset_cache(self) -> None:
        """Forget every published prefix (pages in use keep their KV)."""
        self._page_of.clear()
        self._hash_of = [None] * self.num_pages
