"""NodeClock: the node's clock extrapolated from an anchor on an injected local clock."""

from __future__ import annotations

from talaria.tui.clock import NodeClock


class Local:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_it_reads_nothing_before_its_first_anchor():
    assert NodeClock(Local()).now() is None


def test_it_runs_on_from_the_anchor_at_its_rate():
    local = Local()
    clock = NodeClock(local, rate=2.0)
    local.t = 5.0
    clock.anchor(100.0)
    local.t = 6.5
    assert clock.now() == 103.0


def test_paused_it_stops_where_it_was_and_resumed_it_goes_on_from_there():
    local = Local()
    clock = NodeClock(local)
    clock.anchor(100.0)
    local.t = 2.0
    clock.pause()
    local.t = 10.0
    assert clock.now() == 102.0
    clock.resume()
    local.t = 11.0
    assert clock.now() == 103.0
