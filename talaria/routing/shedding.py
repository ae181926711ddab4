"""Overload that keeps admitted agent sessions alive (`overload = "sessions"`, the default).

When no instance admits a call, what happens depends on whose call it is:

- a call of a session already admitted (one that had a call placed within `session_ttl_s`: a live
  lease, a known session id, a conversation recognised by continuity) waits in the gateway's
  bounded queue until an instance admits it: an agent in the middle of its task is never turned
  away for load;
- a new session waits too while its tenant holds fewer than its fair share of the sessions active
  in the last ACTIVE_WINDOW_S (the active sessions divided by the tenants that have any, its own
  counted), so one tenant flooding new sessions cannot get every other tenant's new sessions shed;
- any other new session is shed: 429 with Retry-After, before it has cost anything.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable

ACTIVE_WINDOW_S = 60.0  # a session with a call this recent counts towards its tenant's share


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

    def waits(self, session: str | None, tenant: str) -> bool:
        """No instance admits this call now: True if it should wait for one, False to shed it."""
        now = self.clock()
        self._expire(now)
        if session is not None and session in self._seen:
            return True
        active = Counter(t for t, last in self._seen.values() if now - last <= ACTIVE_WINDOW_S)
        tenants = len(active) + (tenant not in active)
        return active[tenant] * tenants < sum(active.values())  # below total / tenants

    def _expire(self, now: float) -> None:
        while self._seen:
            _, (_, last) = next(iter(self._seen.items()))
            if now - last <= self.ttl_s:
                break
            self._seen.popitem(last=False)
