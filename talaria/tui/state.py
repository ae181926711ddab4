"""The dashboard's data model: telemetry snapshots and event records folded into what the panels show.

A feed (live node or replayed log, talaria/tui/feed.py) calls `apply_event` for every event record
and `apply_telemetry` for every `GET /talaria/telemetry` body; the panels read the result and the
clock. Nothing here knows about Textual or HTTP, and nothing reads a clock: a countdown is asked
for at a node time (`now`) the caller supplies, so tests can freeze time.

The event log says how things got here (rounds, switches, leases, routes); the snapshot says how
they are now (queues, KV pages, staging, the open slot, the router's live leases). Where both
speak, the event log is folded first-hand and the snapshot repairs what the log missed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Any

from talaria.config.schema import Pool
from talaria.contracts.events import EventKind
from talaria.contracts.profile import Profile, ProfileError
from talaria.contracts.profile_file import parse_profile
from talaria.contracts.telemetry import InstanceStats, InstanceTelemetry, NodeTelemetry
from talaria.tui.leases import LeaseBook
from talaria.tui.memory import ArenaUsage, DeviceMemory, arena_usage
from talaria.tui.switches import SwitchLog
from talaria.tui.timeline import RoundTimeline

ROUTER = "router"  # the envelope instance of route and lease events
KEEP_SESSIONS = 64


class Connection(Enum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    DISCONNECTED = "disconnected"
    REPLAYING = "replaying"
    PAUSED = "paused"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class FeedStatus:
    """Where the data comes from and whether it is flowing; the status bar shows it."""

    connection: Connection
    source: str  # the node's URL or the replayed file
    detail: str = ""  # why it is disconnected, or how far a replay is


@dataclass(frozen=True, slots=True)
class SessionRoute:
    """A session's latest placement, from its last `route` event."""

    session: str
    model: str
    target: str | None  # None when the overload policy rejected the call
    reason: str
    t: float


@dataclass(frozen=True, slots=True)
class PeerRow:
    """Another node in this node's peer set, from telemetry `router.peers` or `peer` events."""

    url: str
    source: str  # static ([[router.peers]]) | dns (peer_dns)
    state: str  # joining | up | down
    why: str | None = None  # why its last heartbeat failed
    instances: int | None = None  # its instances in this node's router; None without telemetry (a replay)
    healthy: int | None = None  # of those, the ones that get placements


@dataclass(frozen=True, slots=True)
class ModelRow:
    """One served model of an instance, for the sessions-and-models panel."""

    model: str
    state: str  # active (weights in the arena) | staged (being staged in the KV tail) | parked (on host)
    # | "?" (not active, and with no snapshot nothing says whether it is staged)
    coverage: float | None  # staging coverage, for the staged model
    waiting: int | None  # None without telemetry (a replay)
    running: int | None


class InstanceView:
    """One instance: its latest telemetry entry, and what the event log says (all a replay has)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.healthy: bool | None = None
        self.in_flight: int | None = None
        self.state: str | None = None  # starting | ready | restarting | stopped
        self.restarts = 0
        self.last_failure: str | None = None
        self.models: tuple[str, ...] = ()
        self.stats: InstanceStats | None = None
        self.profile: Profile | None = None
        self._profile_text: str | None = None
        self._event_active: str | None = None  # the model of its latest switch or slot phase
        self._event_models: dict[str, None] = {}  # models its events or routes mention, in order

    def observe(self, entry: InstanceTelemetry) -> None:
        """One instance entry of a telemetry body; a snapshot older than the one held is dropped."""
        self.healthy, self.in_flight = entry.healthy, entry.in_flight
        self.state, self.restarts, self.last_failure = entry.state, entry.restarts, entry.last_failure
        self.models = entry.models or self.models
        stats = entry.stats
        if stats is not None and (self.stats is None or stats.version > self.stats.version):
            self.stats = stats
            self.models = self.models or stats.models
        text = entry.profile
        if text is not None and text != self._profile_text:
            self._profile_text = text
            try:
                self.profile = parse_profile(text, f"{self.name} profile")
            except ProfileError:
                self.profile = None  # an unreadable profile only costs the HBM split

    def saw_model(self, model: str, active: bool = False) -> None:
        self._event_models.setdefault(model, None)
        if active:
            self._event_active = model

    @property
    def active_model(self) -> str | None:
        return self.stats.active_model if self.stats is not None else self._event_active

    @property
    def pool(self) -> str | None:
        return self.stats.pool if self.stats is not None else None

    def model_rows(self) -> list[ModelRow]:
        queues = {q.model: q for q in self.stats.queues} if self.stats is not None else {}
        staged = self.stats.staged_model if self.stats is not None else None
        coverage = self.stats.substrate.get("staging_coverage") if self.stats is not None else None
        rows = []
        for m in self.models or tuple(self._event_models):
            state = "active" if m == self.active_model else "staged" if m == staged else "parked"
            if self.stats is None and state != "active":
                state = "?"
            q = queues.get(m)
            rows.append(ModelRow(m, state, coverage if state == "staged" else None,
                                 q.waiting if q else None, q.running if q else None))
        return rows

    def arena(self) -> ArenaUsage | None:
        return arena_usage(self.stats, self.profile) if self.stats is not None else None

    def session_kv(self, session: str) -> dict | None:
        """The snapshot's entry for a session whose last call finished here."""
        if self.stats is None:
            return None
        return next((s for s in reversed(self.stats.sessions) if s.get("session") == session), None)


class DashboardState:
    """Everything the panels show, folded from a feed."""

    def __init__(self) -> None:
        self.instances: dict[str, InstanceView] = {}
        self.router: dict[str, Any] = {}  # the telemetry's router section: counters, live leases
        self.devices: tuple[DeviceMemory, ...] = ()  # this machine's GPUs or RAM (live, local node only)
        self.status = FeedStatus(Connection.CONNECTING, "")
        self.telemetry_time: float | None = None  # node clock of the latest telemetry body
        self.peer_dns: str | None = None  # the name peers are found by, when telemetry says
        self._listed: list[str] = []  # instance names in the telemetry's (config) order
        self.reset_events()

    def reset_events(self) -> None:
        """Forget everything the event log said: the node restarted, its sequence numbers with it."""
        self.timelines: dict[str, RoundTimeline] = {}
        self.switches = SwitchLog()
        self.leases = LeaseBook()
        self.routes: OrderedDict[str, SessionRoute] = OrderedDict()
        self.peers: dict[str, PeerRow] = {}  # by URL, in the order they joined
        self.last_seq = 0
        self.events = 0
        self.malformed = 0  # event records or snapshots this version cannot read (a newer or foreign writer)

    # ---- folding ---------------------------------------------------------------------------------

    def apply_event(self, e: dict[str, Any]) -> None:
        """Fold one event record (docs/events.md); kinds the panels do not draw only count."""
        self.last_seq = max(self.last_seq, e.get("seq", 0))
        self.events += 1
        handler = _HANDLERS.get(e.get("kind"))
        if handler is None:
            return
        try:
            handler(self, e)
        except (KeyError, TypeError, ValueError):
            self.malformed += 1

    def apply_telemetry(self, body: dict[str, Any]) -> None:
        """Fold one `GET /talaria/telemetry` body."""
        telemetry = NodeTelemetry.from_dict(body)
        self.malformed += len(telemetry.unreadable)  # entries this version cannot read: keep the last good ones
        self._listed = list(telemetry.instances) + list(telemetry.unreadable)
        for name, entry in telemetry.instances.items():
            view = self.instance(name)
            view.observe(entry)
            if view.stats is None:
                continue
            for record in view.stats.last_switches:
                self.switches.add(name, record)
            if view.stats.rounds is not None:
                self.timeline(name).observe(view.stats.rounds, view.stats.time)
        self.router = telemetry.router
        peers = self.router.get("peers")
        if isinstance(peers, dict) and isinstance(peers.get("members"), list):
            self.peer_dns = peers.get("dns")
            try:
                self.peers = {m["url"]: PeerRow(m["url"], m["source"], m["state"], m.get("why"), m.get("instances"),
                                                m.get("healthy_instances")) for m in peers["members"]}
            except (KeyError, TypeError):
                self.malformed += 1
        t = body.get("time")
        if t is not None:
            self.telemetry_time = t
            if "leases" in self.router:
                self.leases.reconcile(self.router["leases"], t)

    def _on_slot_phase(self, e: dict[str, Any]) -> None:
        self.timeline(e["instance"]).add_phase(e)
        self.instance(e["instance"]).saw_model(e["model"], active=True)

    def _on_switch(self, e: dict[str, Any]) -> None:
        self.switches.add(e["instance"], e, e["t"])
        self.timeline(e["instance"]).add_switch(e)
        self.instance(e["instance"]).saw_model(e["to_model"], active=True)

    def _on_sp_admit(self, e: dict[str, Any]) -> None:
        self.timeline(e["instance"]).add_admit(e)
        self.instance(e["instance"]).saw_model(e["model"], active=True)

    def _on_kv(self, e: dict[str, Any]) -> None:
        """A KV save or restore works on the active model's pool (a switch's saves come before it)."""
        self.instance(e["instance"]).saw_model(e["model"], active=True)

    def _on_round(self, e: dict[str, Any]) -> None:
        self.timeline(e["instance"]).add_round(e)

    def _on_lease(self, e: dict[str, Any]) -> None:
        self.leases.apply(e)

    def _on_peer(self, e: dict[str, Any]) -> None:
        """A peer went up or down, or left the set; telemetry, when there is some, repairs the rest."""
        if e["op"] == "left":
            self.peers.pop(e["peer"], None)
            return
        old = self.peers.get(e["peer"])
        self.peers[e["peer"]] = PeerRow(e["peer"], e["source"], e["op"], e.get("why"),
                                        old.instances if old else None, old.healthy if old else None)

    def _on_route(self, e: dict[str, Any]) -> None:
        if e.get("session") is None:
            return
        self.routes[e["session"]] = SessionRoute(e["session"], e["model"], e.get("target"), e["reason"], e["t"])
        self.routes.move_to_end(e["session"])
        while len(self.routes) > KEEP_SESSIONS:
            self.routes.popitem(last=False)
        if e.get("target"):
            self.instance(e["target"]).saw_model(e["model"])

    # ---- reading ---------------------------------------------------------------------------------

    def instance(self, name: str) -> InstanceView:
        if name not in self.instances:
            self.instances[name] = InstanceView(name)
        return self.instances[name]

    def timeline(self, name: str) -> RoundTimeline:
        if name not in self.timelines:
            self.timelines[name] = RoundTimeline()
        return self.timelines[name]

    def instance_names(self) -> list[str]:
        """Instances in config order (as telemetry lists them), then any others in order seen."""
        return self._listed + [n for n in self.instances if n not in self._listed]

    def cold_instances(self) -> list[str]:
        """Instances with a round scheduler: cold in telemetry, or with round events (a replay)."""
        return [n for n in self.instance_names()
                if self.instances[n].pool is Pool.COLD or (self.instances[n].pool is None and n in self.timelines)]

    def recent_sessions(self, n: int) -> list[SessionRoute]:
        """The `n` sessions routed most recently, newest first."""
        return list(self.routes.values())[-n:][::-1] if n > 0 else []


_HANDLERS = {
    EventKind.SLOT_PHASE: DashboardState._on_slot_phase,
    EventKind.SWITCH: DashboardState._on_switch,
    EventKind.SP_ADMIT: DashboardState._on_sp_admit,
    EventKind.ROUND: DashboardState._on_round,
    EventKind.LEASE: DashboardState._on_lease,
    EventKind.ROUTE: DashboardState._on_route,
    EventKind.PEER: DashboardState._on_peer,
    EventKind.KV_CHECKPOINT: DashboardState._on_kv,
    EventKind.KV_RESTORE: DashboardState._on_kv,
}
