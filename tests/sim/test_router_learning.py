"""The router learns an instance's real speed: its prices are the profile's times the instance's own
measured correction, so a machine that slows down is predicted as slow and given less new work."""

from __future__ import annotations

from talaria.config.schema import InstanceConfig, ModelConfig, Pool, TalariaConfig
from talaria.contracts.trace import TraceCall
from talaria.sim.simulation import SimOptions, Simulation
from tests.routing.test_router import (
    PROFILE,  # model m: prefill 1 ms/token, decode 10 ms
)

HOT = tuple(InstanceConfig(f"h{i}", Pool.HOT, ("m",), arena_bytes=8 << 30, page_size=16, ttft_s=5.0)
            for i in range(2))
CONFIG = TalariaConfig(None, models=(ModelConfig("m", "synthetic:"),), instances=HOT)
SLOW_FROM, FACTOR, HEARTBEAT = 10.0, 2.0, 0.5


def trace() -> list[TraceCall]:
    """A new session every 0.5 s, each 3 calls of ~2K tokens with 0.5 s tool gaps."""
    return [TraceCall(f"s{s}", k, "m", 2000 + 300 * k, 0 if k == 0 else 1900 + 300 * (k - 1), 40,
                      0.5 * s if k == 0 else 0.5)
            for s in range(60) for k in range(3)]


def test_a_slowed_instance_is_priced_slow_within_20_snapshots_and_gets_fewer_new_sessions():
    sim = Simulation(CONFIG, PROFILE, trace(), SimOptions(heartbeat_s=HEARTBEAT, slowdown={"h0": (SLOW_FROM, FACTOR)}))
    seen: list[float] = []

    def probe() -> None:  # what the router's view of h0 holds: the correction its prices are scaled by
        seen.append(sim.router.views["h0"].snapshot.cost_scale.get("m/prefill", 1.0))

    sim.loop.at(SLOW_FROM + 20 * HEARTBEAT + 0.01, probe)  # the 20th snapshot after the slowdown
    r = sim.run()
    [scale] = seen
    assert abs(scale - FACTOR) <= 0.2 * FACTOR  # predicted within 20% of measured
    firsts = [c for c in r.calls if c.index == 0 and c.instance is not None]  # placed (overload may shed)
    before = [c.instance for c in firsts if c.intended < SLOW_FROM]
    after = [c.instance for c in firsts if c.intended >= SLOW_FROM + 20 * HEARTBEAT]
    assert before.count("h0") / len(before) >= 0.4  # the two instances shared new sessions evenly
    assert after.count("h0") / len(after) < 0.25  # then placement moved away from the slow one
