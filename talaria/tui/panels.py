"""The dashboard's panels: each redraws itself from the `DashboardState` at a node time.

Every panel's `draw(state, now, width)` returns Rich text and reads nothing but those and its own
height, so what a panel shows is a function of the state, the clock and the terminal size (the
snapshot tests rely on it). Glyphs carry the
meaning and colours only repeat it, so the panels read the same in a monochrome terminal.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from talaria.tui.leases import Lease
from talaria.tui.state import Connection, DashboardState, InstanceView
from talaria.tui.timeline import SWITCH, RoundTimeline, RoundView, paint

PHASE_STYLE = {"P": "bold black on #5fafff", "D": "black on #87d787", "S": "bold black on #ffaf5f",
               "~": "bold white on #d75f87", "·": "#808080", "░": "#4e4e4e"}
REGION_GLYPH = {"weights": "█", "state": "▞", "kv": "▓", "staging": "▒", "free": "░", "runtime": "▚"}
GLYPH_REGION = {g: r for r, g in REGION_GLYPH.items()}
REGION_STYLE = {"weights": "#5fafff", "state": "#d7d75f", "kv": "#87d787", "staging": "#ffaf5f",
                "free": "#4e4e4e", "runtime": "#af87ff"}
PHASE_SHORT = ("save", "open", "kv", "rt", "pub")  # PHASE_NAMES, as the panel labels them
PEER_STATE_STYLE = {"up": "bold green", "joining": "yellow", "down": "bold red"}
MODEL_STATE_STYLE = {"active": "bold green", "staged": "yellow", "parked": "dim", "?": "dim"}
MIN_BAR = 10
NAME_MAX, MODEL_MAX, INSTANCE_MAX = 14, 12, 10  # column caps: longer session ids and names are cut with …


class Panel(Static, can_focus=True):
    """A bordered, focusable panel that redraws itself from the state."""

    TITLE = ""

    def on_mount(self) -> None:
        self.border_title = self.TITLE

    def show(self, state: DashboardState, now: float | None) -> None:
        text = self.draw(state, now, max(self.size.width, 2 * MIN_BAR))
        text.rstrip()
        self.update(text)

    def draw(self, state: DashboardState, now: float | None, width: int) -> Text:
        raise NotImplementedError


class RoundsPanel(Panel):
    """Per cold instance, the open (or last) round as a slot timeline against the round budget."""

    TITLE = "Rounds"

    def draw(self, state: DashboardState, now: float | None, width: int) -> Text:
        out = Text()
        for glyph, name in (("P", "prefill"), ("D", "decode"), ("S", "session-prefill"), ("~", "switch"),
                            ("·", "between steps"), ("░", "budget left")):
            out.append(glyph, PHASE_STYLE[glyph]).append(f" {name}  ", "dim")
        names = state.cold_instances()
        if not names:
            return out.append("\nno cold instance yet: rounds run on cold pools", "dim")
        for name in names:
            out.append("\n")
            _draw_round(out, name, state.timeline(name), now, width)
        return out


def _draw_round(out: Text, name: str, timeline: RoundTimeline, now: float | None, width: int) -> None:
    view = timeline.view(now)
    out.append(name, "bold")
    if view is None:
        out.append("  no round yet\n", "dim")
        return
    elapsed = view.end - view.start
    budget = f" of {view.budget_s:.2f} s" if view.budget_s else ""
    out.append(f"  round {view.number} " + ("open" if view.closed is None else "closed"))
    out.append(f"  {elapsed:.3f} s{budget}", "red" if view.budget_s and elapsed > view.budget_s else "")
    slot = view.slot
    if slot is not None:
        out.append(f"  slot {slot['model']} {slot['phase']} {slot['elapsed_s']:.2f}/{slot['budget_s']:.2f} s")
    out.append("\n")
    bar = paint(view, max(MIN_BAR, width - 8))
    for glyph in bar:
        out.append(glyph, PHASE_STYLE.get(glyph, ""))
    out.append(f" {view.span_s:.2f} s\n", "dim")
    out.append(_slot_labels(view, len(bar)) + "\n", "italic")
    last = view.closed or timeline.last_closed
    if last is not None:
        out.append(f"round {last.number}: P {last.p_s:.3f}  D {last.d_s:.3f}  SP {last.sp_s:.3f}  "
                   f"switch {last.switch_s:.3f} s  SP admitted {last.sp_admitted} parked {last.sp_parked}\n", "dim")
    if view.admits:
        out.append("SP admits: " + "  ".join(f"{a['session']} {a['cached_tokens']}/{a['tokens']} cached"
                                             for a in view.admits[-4:]) + "\n")
    risk = timeline.state.deadline_risk if timeline.state is not None else {}
    if risk:
        out.append("deadline risk since start: " + "  ".join(f"{k} {v}" for k, v in sorted(risk.items())) + "\n",
                   "red")


def _slot_labels(view: RoundView, width: int) -> str:
    """Each slot's model name under the column where the slot starts."""
    span = view.span_s or 1.0
    starts: list[tuple[int, str]] = []
    for seg in view.segments:
        if seg.kind != SWITCH and (not starts or starts[-1][1] != seg.model):
            starts.append((min(width - 1, int((seg.start - view.start) / span * width)), seg.model))
    line = [" "] * width
    for i, (col, model) in enumerate(starts):
        room = (starts[i + 1][0] if i + 1 < len(starts) else width) - col - 1
        line[col:col + max(0, room)] = model[:max(0, room)]
    return "".join(line).rstrip()


class SwitchesPanel(Panel):
    """Switch counts and time by load path, and the last switches with their phases."""

    TITLE = "Switch paths"

    def draw(self, state: DashboardState, now: float | None, width: int) -> Text:
        log = state.switches
        out = Text(f"{'path':<10}{'count':>6}{'p50 ms':>10}{'p90 ms':>10}{'max ms':>10}\n", "bold")
        top = max(log.counts.values(), default=0)
        for path in log.paths():
            q = [log.percentile(path, x) for x in (0.5, 0.9, 1.0)]
            cells = "".join(f"{x:>10.2f}" if x is not None else f"{'-':>10}" for x in q)
            out.append(f"{path:<10}{log.counts[path]:>6}{cells} ")
            out.append("█" * (round(8 * log.counts[path] / top) if top else 0) + "\n", "#5fafff")
        recent = log.recent(max(1, (self.size.height - len(log.paths()) - 2) // 2 if self.size.height else 4))
        if not recent:
            return out.append("no switch yet", "dim")
        out.append("last switches (slowest rank's phases, ms)\n", "bold")
        for s in recent:
            out.append(f"{s.instance} {s.from_model or '-'} → {s.to_model} ")
            out.append(s.path, "bold").append(f" {s.total_ms:.2f} ms\n")
            phases = " ".join(f"{n} {ms:.2f}" for n, ms in zip(PHASE_SHORT, s.phase_ms))
            moved = f" · D2D {_bytes(s.staged_bytes)}" + (f", dirty {_bytes(s.dirty_bytes)}" if s.dirty_bytes else "")
            out.append(f"  {phases}{moved}\n", "dim")
        return out


class MemoryPanel(Panel):
    """Each instance's arena split per rank, and this machine's device memory."""

    TITLE = "HBM"

    def draw(self, state: DashboardState, now: float | None, width: int) -> Text:
        out = Text()
        arenas = [a for v in state.instances.values() if (a := v.arena()) is not None]
        for region, glyph in REGION_GLYPH.items():
            if region != "state" or any(a.state for a in arenas):  # the state region only where one is shown
                out.append(glyph, REGION_STYLE[region]).append(f" {region}  ", "dim")
        out.append("\n")
        for name in state.instance_names():
            _draw_arena(out, state.instances[name], width)
        for d in state.devices:
            out.append(f"{d.name}  {_bytes(d.used)} of {_bytes(d.total)} used\n")
            out.append(_proportional([("█", d.used), ("░", d.total - d.used)], width) + "\n", "#af87ff")
        if not any(v.stats is not None for v in state.instances.values()):
            out.append("arena split: needs telemetry (live only)\n", "dim")
        if not state.devices:
            out.append("device memory: shown for a node on this machine only", "dim")
        return out


def _draw_arena(out: Text, view: InstanceView, width: int) -> None:
    arena = view.arena()
    if arena is None:
        if view.stats is not None:
            out.append(f"{view.name}  no cost profile yet: arena split unknown\n", "dim")
        return
    size = f"{_bytes(arena.total)} arena" if arena.runtime is not None else "arena size not reported"
    out.append(view.name, "bold").append(f"  {arena.device} · {arena.ranks} rank(s), each {size}\n")
    for glyph in _proportional([(REGION_GLYPH[r], n) for r, n in arena.regions()], width):
        out.append(glyph, REGION_STYLE[GLYPH_REGION[glyph]])
    out.append(f"\nweights {_bytes(arena.weights)} {arena.model} · kv {_bytes(arena.kv_used)} · "
               f"free {_bytes(arena.kv_free)}\n", "dim")
    staging = f"staging {_bytes(arena.staging)}"
    if arena.staged_model:
        staging += f" {arena.staged_model} {arena.coverage:.0%}"
    runtime = f" · runtime {_bytes(arena.runtime)}" if arena.runtime is not None else ""
    out.append(staging + runtime + "\n", "dim")
    slots = f" x {arena.state // arena.state_bytes} slots" if arena.state else ""
    out.append(f"page {_bytes(arena.page_bytes)} · state {_bytes(arena.state_bytes)}{slots}\n", "dim")


class LeasesPanel(Panel):
    """Live leases with their countdown to expiry, soonest first."""

    TITLE = "Leases"

    def draw(self, state: DashboardState, now: float | None, width: int) -> Text:
        leases = state.leases.live()
        cols = (_width(["session"] + [x.session for x in leases], NAME_MAX),
                _width(["model"] + [x.model for x in leases], MODEL_MAX),
                _width(["instance"] + [x.instance for x in leases], INSTANCE_MAX))
        head = "  ".join(f"{h:<{n}}" for h, n in zip(("session", "model", "instance"), cols))
        out = Text(f"{head}{'expires':>9}  {'KV tok':>6}\n", "bold")
        if not leases:
            out.append("no live lease\n", "dim")
        rows = self.size.height - 2 if self.size.height > 2 else len(leases)
        bar = max(0, width - sum(cols) - 24)
        for lease in leases[:rows]:
            _draw_lease(out, lease, now, cols, bar)
        ops = state.leases.ops
        out.append(f"installed {ops['install']} · consumed {ops['consume']} · expired {ops['expire']} · "
                   f"discarded {ops['discard']}", "dim")
        return out


def _draw_lease(out: Text, lease: Lease, now: float | None, cols: tuple[int, int, int], bar: int) -> None:
    names = "  ".join(_cell(x, n) for x, n in zip((lease.session, lease.model, lease.instance), cols))
    left = f"{lease.remaining(now):>7.2f} s" if now is not None else f"{'?':>9}"
    kv = str(lease.kv_tokens) if lease.kv_tokens is not None else "-"
    out.append(f"{names}{left}  {kv:>6} ")
    full = round(bar * lease.fraction(now)) if now is not None else 0
    out.append("█" * full, "#87d787").append("░" * (bar - full) + "\n", "#4e4e4e")


class SessionsPanel(Panel):
    """Per instance its models (active, staged, parked) and queues; the peer set, when the node has
    peers; then the latest sessions."""

    TITLE = "Sessions and models"

    def draw(self, state: DashboardState, now: float | None, width: int) -> Text:
        out = Text()
        views = [state.instances[n] for n in state.instance_names()]
        model_col = _width([r.model for v in views for r in v.model_rows()], MODEL_MAX)
        for view in views:
            _draw_instance(out, view, model_col)
        _draw_peers(out, state)
        routes = state.recent_sessions(max(1, self.size.height - out.plain.count("\n") - 1)
                                       if self.size.height else 8)
        if not routes:
            return out.append("no session routed yet", "dim")
        out.append("recent sessions: model, instance, route, KV tokens\n", "bold")
        cols = (_width([r.session for r in routes], NAME_MAX), _width([r.model for r in routes], MODEL_MAX),
                _width([r.target or "rejected" for r in routes], INSTANCE_MAX))
        for r in routes:
            kv = state.instances[r.target].session_kv(r.session) if r.target in state.instances else None
            where = f"{kv['kv_tokens']:>5} {kv['location']}" if kv else ""
            names = " ".join(_cell(x, n) for x, n in zip((r.session, r.model, r.target or "rejected"), cols))
            out.append(f"  {names} {r.reason:<9} {where}\n")
        return out


def _draw_instance(out: Text, view: InstanceView, model_col: int) -> None:
    out.append(view.name, "bold")
    facts = [view.pool] if view.pool else []
    if view.healthy is not None:
        facts.append("healthy" if view.healthy else f"UNHEALTHY ({view.state})" if view.state else "UNHEALTHY")
    if view.restarts:
        facts.append(f"{view.restarts} restart{'s' if view.restarts > 1 else ''}")
    if view.in_flight is not None:
        facts.append(f"{view.in_flight} in flight")
    sub = view.stats.substrate if view.stats is not None else {}
    if "host_kv_slabs_total" in sub:
        facts.append(f"HKVR {sub['host_kv_slabs_used']}/{sub['host_kv_slabs_total']}")
    out.append("  " + " · ".join(facts) + "\n", "red" if view.healthy is False else "")
    if view.last_failure and view.healthy is False:
        out.append(f"  last failure: {view.last_failure}\n", "red")
    for row in view.model_rows():
        out.append(f"  {_cell(row.model, model_col)} ").append(f"{row.state:<7}", MODEL_STATE_STYLE[row.state])
        out.append(f"{row.coverage:>5.0%}" if row.coverage is not None else " " * 5)
        if row.waiting is not None:
            out.append(f"  waiting {row.waiting}  running {row.running}")
        out.append("\n")


def _draw_peers(out: Text, state: DashboardState) -> None:
    if not state.peers and state.peer_dns is None:
        return
    out.append("peers", "bold").append(f"  found by {state.peer_dns}\n" if state.peer_dns else "\n")
    if not state.peers:
        out.append("  none yet\n", "dim")
    col = _width([url.removeprefix("http://") for url in state.peers], NAME_MAX + 10)
    for peer in state.peers.values():
        facts = [peer.source]
        if peer.instances is not None:
            facts.append(f"{peer.healthy}/{peer.instances} instances healthy")
        out.append(f"  {_cell(peer.url.removeprefix('http://'), col)} ")
        out.append(f"{peer.state:<7}", PEER_STATE_STYLE.get(peer.state, ""))
        out.append(" · ".join(facts) + "\n", "red" if peer.state == "down" else "")
        if peer.state == "down" and peer.why:
            out.append(f"    {peer.why}\n", "red")


class StatusBar(Static):
    """One line: where the data comes from and whether it flows; loud when the node is gone."""

    def show(self, state: DashboardState) -> None:
        st = state.status
        gone = st.connection is Connection.DISCONNECTED
        self.set_class(gone, "-disconnected")
        head = " DISCONNECTED " if gone else f" {st.connection.value} "
        line = Text(head, "bold reverse")
        line.append(f" {st.source}")
        if st.detail:
            line.append(f" · {st.detail}")
        if gone:
            line.append(" · retrying")
        line.append(f" · seq {state.last_seq}")
        if state.malformed:
            line.append(f" · {state.malformed} unreadable records skipped")
        self.update(line)


def _proportional(parts: list[tuple[str, int]], width: int) -> str:
    """`width` cells shared among parts by size (largest remainder); a non-empty part gets at
    least one cell, so a small region stays visible next to a large one."""
    total = sum(n for _, n in parts)
    if total <= 0 or width <= 0:
        return ""
    shares = [n * width / total for _, n in parts]
    cells = [max(1, int(s)) if n > 0 else 0 for s, (_, n) in zip(shares, parts)]
    while sum(cells) > width:
        cells[cells.index(max(cells))] -= 1
    by_remainder = sorted((i for i, (_, n) in enumerate(parts) if n > 0),
                          key=lambda i: shares[i] - int(shares[i]), reverse=True)
    for i in by_remainder[:width - sum(cells)]:
        cells[i] += 1
    return "".join(glyph * c for (glyph, _), c in zip(parts, cells))


def _width(values: list[str], cap: int) -> int:
    """A column wide enough for `values`, at most `cap`."""
    return min(cap, max((len(v) for v in values), default=0))


def _cell(value: str, width: int) -> str:
    """`value` left-aligned in `width` columns, cut with … when longer."""
    return f"{value:<{width}}" if len(value) <= width else value[:width - 1] + "…"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
