"""Routing policies with an injected clock: least-pressure choice, sticky leases, expiry, fallback."""

from dataclasses import dataclass

import pytest

from talaria.config.schema import RouterConfig, RouterPolicy
from talaria.node.errors import InstanceUnavailable
from talaria.router.policies import (
    LeastPressure,
    SessionSticky,
    SessionTable,
    UnknownPolicy,
    make_policy,
)


@dataclass
class Group:
    name: str
    in_flight: int = 0
    healthy: bool = True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_least_pressure_picks_fewest_in_flight_among_healthy():
    groups = [Group("a", 3), Group("b", 0, healthy=False), Group("c", 1), Group("d", 2)]
    assert LeastPressure().route("m", None, groups).name == "c"


def test_least_pressure_ties_go_to_the_first_group():
    groups = [Group("a", 1), Group("b", 1)]
    assert LeastPressure().route("m", "s", groups).name == "a"


def test_no_healthy_group_raises_instance_unavailable():
    with pytest.raises(InstanceUnavailable, match="'m'"):
        LeastPressure().route("m", None, [Group("a", healthy=False)])
    with pytest.raises(InstanceUnavailable):
        LeastPressure().route("m", None, [])


def test_sticky_returns_to_last_group_within_lease_even_if_busier():
    clock = Clock()
    policy = SessionSticky(lease_s=1.0, clock=clock)
    a, b = Group("a", 0), Group("b", 0)
    first = policy.route("m", "s1", [a, b])
    assert first is a
    policy.complete("m", "s1", "a")
    a.in_flight = 5
    clock.now += 1.0  # exactly at the lease boundary still counts (now - last_done <= lease_s)
    assert policy.route("m", "s1", [a, b]) is a
    assert policy.route("m", "other", [a, b]) is b  # sessions without history: least-pressure


def test_sticky_lease_expires():
    clock = Clock()
    policy = SessionSticky(lease_s=1.0, clock=clock)
    a, b = Group("a", 5), Group("b", 0)
    policy.complete("m", "s1", "a")
    clock.now += 1.01
    assert policy.route("m", "s1", [a, b]) is b


def test_sticky_falls_back_when_last_group_unhealthy_or_gone():
    clock = Clock()
    policy = SessionSticky(lease_s=10.0, clock=clock)
    a, b, c = Group("a", 0, healthy=False), Group("b", 4), Group("c", 2)
    policy.complete("m", "s1", "a")
    assert policy.route("m", "s1", [a, b, c]) is c
    assert policy.route("m", "s1", [b, c]) is c


def test_sticky_is_per_model():
    clock = Clock()
    policy = SessionSticky(lease_s=10.0, clock=clock)
    a, b = Group("a", 1), Group("b", 0)
    policy.complete("m1", "s", "a")
    assert policy.route("m1", "s", [a, b]) is a
    assert policy.route("m2", "s", [a, b]) is b


def test_session_table_evicts_least_recently_finished_beyond_capacity():
    clock = Clock()
    table = SessionTable(ttl_s=100.0, clock=clock, capacity=2)
    table.put("s1", "m", "a")
    clock.now += 1
    table.put("s2", "m", "a")
    clock.now += 1
    table.put("s1", "m", "b")  # refreshes s1: s2 is now the oldest
    table.put("s3", "m", "c")
    assert len(table) == 2
    assert table.get("s2", "m") is None
    assert table.get("s1", "m") == "b" and table.get("s3", "m") == "c"


def test_session_table_drops_expired_entries():
    clock = Clock()
    table = SessionTable(ttl_s=1.0, clock=clock)
    table.put("s1", "m", "a")
    clock.now += 0.5
    table.put("s2", "m", "a")
    clock.now += 0.75  # s1 is 1.25 s old, s2 0.75 s
    assert table.get("s1", "m") is None
    assert len(table) == 1 and table.get("s2", "m") == "a"


def test_make_policy_from_config():
    clock = Clock()
    assert isinstance(make_policy(RouterConfig(policy=RouterPolicy.LEAST_PRESSURE), clock), LeastPressure)
    assert isinstance(make_policy(RouterConfig(policy=RouterPolicy.SESSION_STICKY), clock), SessionSticky)
    with pytest.raises(UnknownPolicy, match="full"):
        make_policy(RouterConfig(policy=RouterPolicy.FULL), clock)
