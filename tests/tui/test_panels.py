"""The dashboard at a fixed terminal size, driven by a real recorded event log and telemetry snapshot
(tests/tui/fixtures, from a `talaria up` with the default config), on a frozen clock.

Each panel's rendered text is compared with a golden file in tests/tui/snapshots/; regenerate them
with TALARIA_UPDATE_SNAPSHOTS=1 and review the diff. Keys are driven through Textual's Pilot.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from pathlib import Path

import httpx
import pytest
from textual.geometry import Region

from talaria.tui.app import DashboardApp, HelpScreen
from talaria.tui.clock import NodeClock
from talaria.tui.feed import LiveFeed, ReplayFeed, read_events
from talaria.tui.state import Connection

pytestmark = pytest.mark.anyio

SIZE = (120, 44)
HERE = Path(__file__).parent
EVENTS = read_events(HERE / "fixtures" / "events.jsonl")
TELEMETRY = json.loads((HERE / "fixtures" / "telemetry.json").read_text())
PANELS = ("status", "rounds", "switches", "memory", "leases", "sessions")
UPDATE = os.environ.get("TALARIA_UPDATE_SNAPSHOTS") == "1"


def panel_text(app: DashboardApp, name: str) -> str:
    """What the panel shows on screen, border and title included, one line per row."""
    widget = app.query_one(f"#{name}")
    strips = widget.render_lines(Region(0, 0, *widget.outer_size))
    return "\n".join(strip.text.rstrip() for strip in strips)


def check_snapshot(name: str, text: str) -> None:
    path = HERE / "snapshots" / f"{name}.txt"
    if UPDATE:
        path.write_text(text + "\n", encoding="utf-8")
        return
    assert path.exists(), f"{path} is missing: run with TALARIA_UPDATE_SNAPSHOTS=1 to write it"
    want = path.read_text(encoding="utf-8").rstrip("\n")
    assert text == want, "\n" + "\n".join(difflib.unified_diff(want.splitlines(), text.splitlines(),
                                                              "snapshot", "now", lineterm=""))


def replay_app(events: list[dict]) -> DashboardApp:
    """The dashboard over `events`, played at once, on a clock that only moves with the replay."""
    return DashboardApp(ReplayFeed(events, "events.jsonl", math.inf, clock=NodeClock(lambda: 0.0)))


async def finished(app: DashboardApp, pilot) -> None:
    while app.state.status.connection is not Connection.FINISHED:
        await pilot.pause(0.01)


@pytest.mark.parametrize("panel", PANELS)
async def test_a_live_node_snapshot(panel):
    """The whole recorded log, then the snapshot taken at its end: the node as a live dashboard sees it."""
    app = replay_app(EVENTS)
    async with app.run_test(size=SIZE) as pilot:
        await finished(app, pilot)
        app.state.apply_telemetry(TELEMETRY)
        app.feed.clock.anchor(TELEMETRY["time"])
        app.redraw()
        await pilot.pause()
        check_snapshot(f"live-{panel}", panel_text(app, panel))


async def test_a_stateful_models_state_slots_are_a_region_of_their_own():
    """cold-0's snapshot says its active model keeps 8 state slots of 500 B and pages of 1 KiB."""
    body = json.loads(json.dumps(TELEMETRY))
    stats = body["instances"]["cold-0"]["stats"]
    stats |= {"page_bytes": {"tiny-llama": 16384, "tiny-qwen3": 1024},
              "state_bytes": {"tiny-llama": 0, "tiny-qwen3": 500}, "state_slots": {"tiny-llama": 0, "tiny-qwen3": 8}}
    app = replay_app([])
    async with app.run_test(size=SIZE) as pilot:
        await finished(app, pilot)
        app.state.apply_telemetry(body)
        app.redraw()
        await pilot.pause()
        lines = [line.strip("│ ") for line in panel_text(app, "memory").splitlines()]
    assert lines[1] == "█ weights  ▞ state  ▓ kv  ▒ staging  ░ free  ▚ runtime"
    assert "page 1.0 KiB · state 500 B x 8 slots" in lines
    assert any(line.startswith("█▞▓▒░") for line in lines)  # cold-0's bar: the state slots above its weights
    assert "page 720.0 KiB · state 0 B" in lines  # hot-0: an older snapshot, its page from the profile


@pytest.mark.parametrize("panel", PANELS)
async def test_a_replay_snapshot_mid_round(panel):
    """The log up to seq 26 with no telemetry: round 2 of cold-0 is open, with an SP admission."""
    app = replay_app([e for e in EVENTS if e["seq"] <= 26])
    async with app.run_test(size=SIZE) as pilot:
        await finished(app, pilot)
        app.redraw()
        await pilot.pause()
        check_snapshot(f"replay-{panel}", panel_text(app, panel))


async def test_tab_moves_between_panels_and_shift_tab_back():
    app = replay_app(EVENTS[:3])
    async with app.run_test(size=SIZE) as pilot:
        order = []
        for _ in range(5):
            order.append(app.focused.id)
            await pilot.press("tab")
        assert order == ["rounds", "switches", "memory", "leases", "sessions"]
        assert app.focused.id == "rounds"  # round again
        await pilot.press("shift+tab")
        assert app.focused.id == "sessions"


@pytest.mark.parametrize("key", ["question_mark", "h"])
async def test_help_opens_and_escape_closes_it(key):
    app = replay_app(EVENTS[:3])
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press(key)
        assert isinstance(app.screen, HelpScreen)
        await pilot.pause(3 * app.redraw_s)  # the panels below keep redrawing
        assert "tab / shift+tab" in str(app.screen.query_one("#help").render())
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_p_pauses_and_resumes_a_replay():
    app = DashboardApp(ReplayFeed(EVENTS, "events.jsonl", 1.0))  # real pace: 8 s of log
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("p")
        assert app.state.status.connection is Connection.PAUSED
        seen = app.state.events
        await pilot.pause(0.3)
        assert app.state.events == seen and "paused" in panel_text(app, "status")
        await pilot.press("p")
        assert app.state.status.connection is Connection.REPLAYING


async def test_q_quits():
    app = replay_app(EVENTS[:3])
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running


async def test_a_node_that_is_away_shows_disconnected_and_hides_pause():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    app = DashboardApp(LiveFeed("http://127.0.0.1:9", transport=httpx.MockTransport(refuse), retry_s=0.05))
    async with app.run_test(size=SIZE) as pilot:
        while app.state.status.connection is not Connection.DISCONNECTED:
            await pilot.pause(0.01)
        app.redraw()
        await pilot.pause()
        status = app.query_one("#status")
        assert status.has_class("-disconnected")
        assert panel_text(app, "status").startswith(" DISCONNECTED  http://127.0.0.1:9 · cannot connect")
        assert app.check_action("pause", ()) is False


async def test_an_instance_in_a_crash_loop_shows_its_restarts_and_why():
    down = json.loads(json.dumps(TELEMETRY))
    cold = down["instances"]["cold-0"]
    cold.update(healthy=False, state="restarting", restarts=3,
                last_failure="stalled: rank 0 sent nothing for 20.5s with 1 calls in flight (limit 20.0s)")
    app = replay_app(EVENTS)
    async with app.run_test(size=SIZE) as pilot:
        await finished(app, pilot)
        app.state.apply_telemetry(down)
        app.feed.clock.anchor(down["time"])
        app.redraw()
        await pilot.pause()
        text = panel_text(app, "sessions")
    assert "UNHEALTHY (restarting)" in text and "3 restarts" in text
    assert "last failure: stalled: rank 0 sent nothing" in text


async def test_the_sessions_panel_lists_the_peer_set_and_why_a_peer_is_down():
    with_peers = json.loads(json.dumps(TELEMETRY))
    with_peers["router"]["peers"] = {"dns": "talaria-peers:8001", "members": [
        {"url": "http://10.0.0.2:8001", "source": "dns", "state": "up", "why": None, "instances": 2,
         "healthy_instances": 2},
        {"url": "http://10.0.0.3:8001", "source": "dns", "state": "down", "why": "ConnectError: refused",
         "instances": 2, "healthy_instances": 0}]}
    app = replay_app(EVENTS)
    async with app.run_test(size=SIZE) as pilot:
        await finished(app, pilot)
        app.state.apply_telemetry(with_peers)
        app.redraw()
        await pilot.pause()
        lines = [line.strip("│ ") for line in panel_text(app, "sessions").splitlines()]
    assert "peers  found by talaria-peers:8001" in lines
    assert "10.0.0.2:8001 up     dns · 2/2 instances healthy" in lines
    down = lines.index("10.0.0.3:8001 down   dns · 0/2 instances healthy")
    assert lines[down + 1] == "ConnectError: refused"
