"""A group that keeps failing restarts ever more slowly, and a group that served again starts the
count over. The failures here are driven through the group's own handlers (`_fail`, the ready
report, a finished call's output) with its processes replaced by a recorder, so the delays can be
read exactly; the real deaths, stalls and respawns are tests/test_lifecycle.py and tests/test_isolation.py.
"""

from __future__ import annotations

import asyncio

from talaria.contracts.call import CallOutput, FinishReason, InstanceReady, Usage
from talaria.node.engine_group import BACKOFF_S, EngineGroup
from tests.tiny_models import instance


class ProcesslessGroupForTest(EngineGroup):
    """An EngineGroup whose spawns and kills are only recorded (no worker processes)."""

    def __init__(self) -> None:
        super().__init__(instance([]), [], threads=1)
        self.spawns = 0
        self.delays: list[float] = []

    def _spawn(self) -> None:
        self._generation += 1
        self._up_since, self._served = None, False
        self.spawns += 1

    def _kill(self) -> None:
        pass

    def ready_now(self) -> None:
        self._deliver([InstanceReady(self.name, (), 8, 0.1)], self._generation)

    def crash(self) -> None:
        real_later = self._loop.call_later
        self._loop.call_later = lambda delay, fn, *args: (self.delays.append(delay), fn(*args))
        try:
            self._fail(self._generation, "lost a worker process (exit codes [-9])")
        finally:
            self._loop.call_later = real_later


def test_crashes_in_a_row_double_the_delay_and_a_served_call_resets_it():
    async def scenario() -> ProcesslessGroupForTest:
        g = ProcesslessGroupForTest()
        g._loop = asyncio.get_running_loop()
        g._spawn()
        g.ready_now()
        assert (g.healthy, g.state) == (True, "ready")
        for _ in range(3):  # up, but down again before it served anything: a crash loop
            g.crash()
            assert g.healthy is False and g.last_failure.startswith("lost a worker")
        g.crash()  # died before reporting ready: still the same loop, not an immediate respawn
        g.ready_now()
        g._deliver([CallOutput("r1", (5,), FinishReason.STOP, Usage(3, 1, 0))], g._generation)  # it served
        g.crash()
        for _ in range(12):
            g.crash()
        return g

    g = asyncio.run(scenario())
    base, cap = BACKOFF_S
    assert g.delays[:5] == [base, 2 * base, 4 * base, 8 * base, base]
    assert g.delays[-1] == cap and max(g.delays) == cap  # a long crash loop waits at most the cap
    assert g.restarts == len(g.delays) == 17 and g.spawns == 18 and g.state == "starting"
