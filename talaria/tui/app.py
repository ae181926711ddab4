"""`talaria tui`: the live dashboard of a node, or of a recorded event log.

A thin Textual app: the feed (talaria/tui/feed.py) folds data into a `DashboardState` from a
worker on the app's event loop, and a timer redraws every panel from the state and the feed's node
clock a few times a second, so countdowns move between updates. Panels and layout live in
talaria/tui/panels.py and talaria/tui/dashboard.tcss.
"""

from __future__ import annotations

from typing import ClassVar

from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid
from textual.screen import ModalScreen
from textual.widgets import Footer, Static

from talaria.tui.feed import Feed, ReplayFeed
from talaria.tui.panels import (
    LeasesPanel,
    MemoryPanel,
    Panel,
    RoundsPanel,
    SessionsPanel,
    StatusBar,
    SwitchesPanel,
)
from talaria.tui.state import DashboardState

REDRAW_S = 0.25

HELP = """\
[b]Talaria dashboard[/b]

[b]Keys[/b]
  tab / shift+tab   move between panels
  p                 pause or resume a replay
  ? or h            this help;  escape closes it
  q                 quit

[b]Panels[/b]
  Rounds        per cold instance, the open (or last) round against its budget:
                P prefill, D decode, S session-prefill, ~ switch, · between steps, ░ budget left
  Switch paths  switches by path (full_d2d, partial, h2d_only): count, p50/p90/max ms;
                the last switches with the slowest rank's phase times
  HBM           each instance's arena per rank: weights, KV in use, staging, free, runtime;
                this machine's GPUs (NVML) or RAM when the node runs here
  Leases        live leases: session, model, instance, seconds to expiry
  Sessions      per instance its models (active, staged, parked) and queues; the peer set
                (up, joining, down and why); recent sessions

[b]Sources[/b]
  live: GET /talaria/telemetry every 0.5 s and GET /talaria/events (SSE), resumed after a drop
  replay: an events JSONL file at its recorded pace times --speed
"""


class HelpScreen(ModalScreen[None]):
    """Keys, panels and sources."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,question_mark,h", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        yield Static(HELP, id="help")


class DashboardApp(App[None]):
    CSS_PATH = "dashboard.tcss"
    TITLE = "talaria"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark,h", "help", "Help", key_display="?"),
        Binding("p", "pause", "Pause replay"),
    ]

    def __init__(self, feed: Feed, state: DashboardState | None = None, *, redraw_s: float = REDRAW_S) -> None:
        super().__init__()
        self.feed = feed
        self.state = state if state is not None else DashboardState()
        self.redraw_s = redraw_s
        self._status = StatusBar(id="status")
        self._panels: list[Panel] = [RoundsPanel(id="rounds"), SwitchesPanel(id="switches"),
                                     MemoryPanel(id="memory"), LeasesPanel(id="leases"),
                                     SessionsPanel(id="sessions")]

    def compose(self) -> ComposeResult:
        yield self._status
        rounds, *others = self._panels
        yield rounds
        with Grid(id="panels"):
            yield from others
        yield Footer()

    def on_mount(self) -> None:
        self.run_worker(self.feed.run(self.state), name="feed", exclusive=True)
        self.set_interval(self.redraw_s, self.redraw)
        self._panels[0].focus()
        self.call_after_refresh(self.redraw)

    def redraw(self) -> None:
        """Draw every panel from the state at the feed's current node time. The widgets are held
        rather than queried: the timer can fire while a help screen is on top, or during exit."""
        now = self.feed.clock.now()
        self._status.show(self.state)
        for panel in self._panels:
            panel.show(self.state, now)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return action != "pause" or isinstance(self.feed, ReplayFeed)  # a live node cannot be paused

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_pause(self) -> None:
        if isinstance(self.feed, ReplayFeed):
            self.feed.toggle_pause(self.state)
        self.redraw()
