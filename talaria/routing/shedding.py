"""Overload that keeps admitted agent sessions alive (`overload = "sessions"`, the default): which
sessions are admitted.

When no instance admits a call, what happens depends on whose call it is:

- a call of a session already admitted (one that had a call placed within `session_ttl_s`: a live
  lease, a known session id, a conversation recognised by continuity) waits in the gateway's
  bounded queue until an instance admits it: an agent in the middle of its task is never turned
  away for load;
- any other call opens a new session: it waits its turn in the admission line, outside the node,
  with a 429 whose Retry-After says when to come back (talaria/routing/admission_line.py, fair
  among tenants there), before it has cost anything.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class SessionShedding:
    def __init__(self, clock: Callable[[], float], ttl_s: float, max_sessions: int) -> None:
        self.clock = clock
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._seen: OrderedDict[str, tuple[str, float]] = OrderedDict()  # session -> (tenant, last call), oldest first

    def admitted(self, session: str | None, tenant: str) -> None:
        """A call of `session` was placed."""
        if session is None:
            return
        self._seen[session] = (tenant, self.clock())
        self._seen.move_to_end(session)
        while len(self._seen) > self.max_sessions:
            self._seen.popitem(last=False)

    def known(self, session: str) -> bool:
        """`session` was admitted: a call of it was placed within `ttl_s`."""
        entry = self._seen.get(session)
        return entry is not None and self.clock() - entry[1] <= self.ttl_s
