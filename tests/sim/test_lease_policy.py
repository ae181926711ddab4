"""`[router] lease_policy` in a simulated run: adaptive tau follows a session's own tool gaps."""

from __future__ import annotations

import dataclasses

import pytest

from talaria.config.schema import LeasePolicy
from talaria.contracts.trace import TraceCall
from talaria.sim.simulation import SimOptions, Simulation
from tests.routing.test_router import PROFILE
from tests.sim.test_simulation import CONFIG

GAP_S = 3.0  # three times the paper's tau (lease_s 1 s): a fixed lease expires in every gap


def slow_tool_session(calls: int = 5) -> list[TraceCall]:
    return [TraceCall("s0", k, "m", 500 + 200 * k, 0 if k == 0 else 400 + 200 * k, 20, 0.0 if k == 0 else GAP_S)
            for k in range(calls)]


def run(policy: LeasePolicy):
    config = dataclasses.replace(CONFIG, router=dataclasses.replace(CONFIG.router, lease_s=1.0, lease_policy=policy))
    r = Simulation(config, PROFILE, slow_tool_session(), SimOptions(keep_events=True)).run()
    installs = [e.data["t_exp"] - e.t for e in r.events if e.kind.value == "lease" and e.data["op"] == "install"]
    return installs, r.router


def test_fixed_leases_live_lease_s_and_expire_in_every_slow_gap():
    installs, router = run(LeasePolicy.FIXED)
    assert installs == pytest.approx([1.0] * 5)
    assert (router["lease_hits"], router["lease_expiries"]) == (0, 4)


def test_adaptive_leases_learn_the_sessions_gaps_and_cover_its_returns():
    installs, router = run(LeasePolicy.ADAPTIVE)
    # lease_s until the first gap; then srtt + 4 rttvar of the 3 s gaps: 3 + 4 x 1.5, 3 + 4 x 1.125, ...
    assert installs == pytest.approx([1.0, 9.0, 7.5, 6.375, 6.0])  # the last: the floor, 2 x srtt
    assert (router["lease_hits"], router["lease_expiries"]) == (3, 1)
