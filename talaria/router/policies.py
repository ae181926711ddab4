"""Which engine group serves a call: the comparison policies of paper §5.3.

A policy is a small strategy object with one verb, `route`, plus `complete`, which the gateway calls
when a call finishes normally so session-aware policies can remember where the session was served.
`make_policy` picks one from `RouterConfig.policy`; the paper's full policy (leases + cost-ranked
placement) belongs to the session-aware router and gets its entry in `POLICIES` when it exists.

Policies see time only through the injected clock, so tests and the simulator drive them
deterministically.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from talaria.config.schema import RouterConfig, RouterPolicy
from talaria.node.errors import InstanceUnavailable

if TYPE_CHECKING:
    from talaria.node.supervisor import EngineGroup

Clock = Callable[[], float]
DEFAULT_SESSION_CAPACITY = 65_536  # sessions remembered at once; the least recently finished go first


class UnknownPolicy(ValueError):
    """The configured router policy has no implementation in this build."""


class RoutingPolicy(Protocol):
    def route(self, model: str, session_id: str | None, groups: Sequence[EngineGroup]) -> EngineGroup:
        """Pick a healthy group among those serving `model`; raise InstanceUnavailable if none is."""
        ...

    def complete(self, model: str, session_id: str | None, group: str) -> None:
        """The call for (`session_id`, `model`) finished normally on `group`."""
        ...


def least_pressure(model: str, groups: Sequence[EngineGroup]) -> EngineGroup:
    """The healthy group with the fewest in-flight calls; ties go to the earliest in `groups`."""
    best = None
    for g in groups:
        if g.healthy and (best is None or g.in_flight < best.in_flight):
            best = g
    if best is None:
        names = ", ".join(g.name for g in groups) or "none configured"
        raise InstanceUnavailable(f"no healthy instance serves model {model!r} right now ({names}); retry shortly")
    return best


class LeastPressure:
    """Fewest in-flight calls; blind to sessions (the paper's request-by-request baseline)."""

    def route(self, model: str, session_id: str | None, groups: Sequence[EngineGroup]) -> EngineGroup:
        return least_pressure(model, groups)

    def complete(self, model: str, session_id: str | None, group: str) -> None:
        pass


class SessionTable:
    """Bounded memory of where each (session, model) last finished and when.

    Entries live at most `ttl_s` after their call finished and at most `capacity` exist; both
    bounds evict from the front, which is kept in finish order.
    invariant: the OrderedDict is sorted by finish time because `put` moves its key to the end and
    the clock is monotonic.
    """

    def __init__(self, ttl_s: float, clock: Clock, capacity: int = DEFAULT_SESSION_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"session table capacity must be >= 1, got {capacity}")
        self._ttl_s = ttl_s
        self._clock = clock
        self._capacity = capacity
        self._entries: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    def get(self, session_id: str, model: str) -> str | None:
        """The group of the session's last call if it finished at most `ttl_s` ago."""
        self._expire(self._clock())
        entry = self._entries.get((session_id, model))
        return None if entry is None else entry[0]

    def put(self, session_id: str, model: str, group: str) -> None:
        now = self._clock()
        key = (session_id, model)
        self._entries[key] = (group, now)
        self._entries.move_to_end(key)
        self._expire(now)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self, now: float) -> None:
        while self._entries:
            _, done_at = next(iter(self._entries.values()))
            if now - done_at <= self._ttl_s:
                return
            self._entries.popitem(last=False)


class SessionSticky:
    """A session's call returns to the group that served its last call, while that call finished at
    most `lease_s` ago and the group is healthy; otherwise least-pressure."""

    def __init__(self, lease_s: float, clock: Clock, capacity: int = DEFAULT_SESSION_CAPACITY) -> None:
        self._table = SessionTable(lease_s, clock, capacity)

    def route(self, model: str, session_id: str | None, groups: Sequence[EngineGroup]) -> EngineGroup:
        if session_id is not None:
            last = self._table.get(session_id, model)
            for g in groups:
                if g.name == last and g.healthy:
                    return g
        return least_pressure(model, groups)

    def complete(self, model: str, session_id: str | None, group: str) -> None:
        if session_id is not None:
            self._table.put(session_id, model, group)


PolicyFactory = Callable[[RouterConfig, Clock], RoutingPolicy]
POLICIES: dict[RouterPolicy, PolicyFactory] = {
    RouterPolicy.LEAST_PRESSURE: lambda config, clock: LeastPressure(),
    RouterPolicy.SESSION_STICKY: lambda config, clock: SessionSticky(config.lease_s, clock),
}


def make_policy(config: RouterConfig, clock: Clock) -> RoutingPolicy:
    """The strategy object for `config.policy`."""
    factory = POLICIES.get(config.policy)
    if factory is None:
        have = ", ".join(p.value for p in POLICIES)
        raise UnknownPolicy(f"[router] policy = {config.policy.value!r} is not implemented yet; use one of: {have}")
    return factory(config, clock)
