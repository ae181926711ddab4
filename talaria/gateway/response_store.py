"""Stored responses, so a Responses API client can continue from `previous_response_id`.

A response created with `store: true` (the API's default) is kept here with the conversation it
continued: the items of its whole chain (earlier inputs and outputs, without any request's
`instructions`, which the API does not carry over) and its own output items. A request naming it
continues that conversation, so its prompt extends the stored call's prompt exactly as if the client
had sent every item back itself.

Bounded, in memory, per tenant (a tenant never sees another's responses, nor learns their ids
exist): at most `per_tenant` responses each, every one dropped `ttl_s` after it was stored, the
oldest first when a tenant is full, and `max_items` items held in all (the oldest responses of any
tenant go first). Items of a chain are shared between its responses, not copied. The limits are in
docs/api.md; a response that is unknown, expired or another tenant's is a 404.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from talaria.gateway.errors import NOT_FOUND, APIError

TTL_S = 3600.0  # a stored response can be continued from for an hour
PER_TENANT = 1024  # responses kept per tenant
MAX_ITEMS = 1 << 20  # item references held, all tenants together


@dataclass(frozen=True, slots=True)
class StoredResponse:
    items: tuple[dict[str, Any], ...]  # the conversation it continued: the chain's inputs and outputs, in order
    output: tuple[dict[str, Any], ...]  # its own output items
    body: dict[str, Any]  # the response object as returned (GET /v1/responses/{id})
    expires: float  # on the store's clock


class ResponseStore:
    def __init__(self, clock: Callable[[], float] = time.monotonic, ttl_s: float = TTL_S,
                 per_tenant: int = PER_TENANT, max_items: int = MAX_ITEMS) -> None:
        self._clock = clock
        self._ttl_s = ttl_s
        self._per_tenant = per_tenant
        self._max_items = max_items
        self._items = 0
        self._all: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()  # oldest first
        self._count: dict[str, int] = {}

    def put(self, tenant: str, response_id: str, items: tuple[dict[str, Any], ...],
            output: tuple[dict[str, Any], ...], body: dict[str, Any]) -> None:
        self._expire()
        stored = StoredResponse(items, output, body, self._clock() + self._ttl_s)
        self._all[(tenant, response_id)] = stored
        self._count[tenant] = self._count.get(tenant, 0) + 1
        self._items += len(items) + len(output)
        while self._count[tenant] > self._per_tenant:
            self._drop(next(k for k in self._all if k[0] == tenant))
        while self._items > self._max_items and len(self._all) > 1:
            self._drop(next(iter(self._all)))

    def get(self, tenant: str, response_id: str, param: str = "previous_response_id") -> StoredResponse:
        """The stored response, or a 404 naming `param`."""
        self._expire()
        stored = self._all.get((tenant, response_id))
        if stored is None:
            raise APIError(404, f"Previous response with id {response_id!r} not found: it was never stored "
                           f"(store: false), has expired (responses are kept {self._ttl_s:g} s), or was "
                           "evicted; send the conversation's items in input instead", NOT_FOUND, param,
                           "previous_response_not_found")
        return stored

    def delete(self, tenant: str, response_id: str) -> None:
        self.get(tenant, response_id, "response_id")
        self._drop((tenant, response_id))

    def _expire(self) -> None:
        now = self._clock()
        while self._all:
            key, oldest = next(iter(self._all.items()))
            if oldest.expires > now:
                return
            self._drop(key)

    def _drop(self, key: tuple[str, str]) -> None:
        stored = self._all.pop(key)
        self._count[key[0]] -= 1
        if not self._count[key[0]]:
            del self._count[key[0]]
        self._items -= len(stored.items) + len(stored.output)
