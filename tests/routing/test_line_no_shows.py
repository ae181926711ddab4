"""The admission line against clients that do not come back for their place (curl, a script without
retries, a user who closed the tab): room no promise needs goes to whoever asks, and a line of
no-shows stops reserving room once a few places are lost. On an injected clock, over the dispatcher
tests' echo instance (tests/routing/test_admission_line.py's `Node`: a 2 s TTFT target, a call's
predicted work its prefill at 1 ms a token)."""

from __future__ import annotations

import pytest

from talaria.routing.admission_line import CONTROL_INTERVAL_S, GRACE_S, AdmissionLine
from talaria.routing.errors import Overloaded
from tests.gateway.fakes import MODEL
from tests.routing.test_admission_line import Node, sessions_in_tool_gaps, two_call_sessions


def one_shot_clients(n: Node, every_s: float, for_s: float) -> list[tuple[float, bool, int]]:
    """A new one-call session every `every_s` for `for_s`, each asking once and never again, whatever
    it is told; the admitted ones' calls end at once. (when, admitted, sessions in line then) each."""
    start, out = n.clock.now, []
    for step in range(int(for_s / CONTROL_INTERVAL_S)):
        n.at(start + step * CONTROL_INTERVAL_S)
        if step % round(every_s / CONTROL_INTERVAL_S):
            continue
        try:
            n.serve(f"once{step}", 1000)
            out.append((n.clock.now - start, True, len(n.d.line)))
        except Overloaded:
            out.append((n.clock.now - start, False, len(n.d.line)))
    return out


@pytest.mark.parametrize("every_s", [2.0, 0.5])
def test_clients_that_never_come_back_do_not_keep_an_idle_node_shut(every_s):
    """Four agent sessions fill the node; then one-call clients arrive and never retry. The first are
    told to come back and do not. Before, each newcomer's promise counted every place kept ahead of it
    as taken: the node sat idle with no session admitted while the line grew by each arrival (22 in
    line after 90 s at one every 2 s; 106 at two a second). Now a newcomer is admitted into room that
    no promise needs, and once a few places are lost the line counts the rest at the share of clients
    that come back: every client of the last minute is admitted at its only call, and the line empties."""
    n = Node()
    two_call_sessions(n, ["w0", "w1", "w2", "w3"], 0.0)
    n.at(n.clock.now + 30.0)
    sessions_in_tool_gaps(n, ["s0", "s1", "s2", "s3"], 0.3)
    trace = one_shot_clients(n, every_s, 90.0)
    assert not trace[0][1]  # the node was full: told to come back, it never does
    assert all(admitted for t, admitted, _ in trace if t >= 30.0)
    assert trace[-1][2] == 0 and len(n.d.line) == 0
    assert n.d.line.comes_back(MODEL) < 0.5
    assert n.d.telemetry()["line"]["comes_back"][MODEL] == pytest.approx(n.d.line.comes_back(MODEL), abs=1e-3)


def promised_the_third_departure() -> tuple[Node, list[float]]:
    """Four agent sessions in their tool gaps, quiet at `quiet` (sorted); "new0" is first in line,
    promised the third departure."""
    n = Node()
    two_call_sessions(n, ["w0", "w1", "w2", "w3"], 0.0)
    n.at(n.clock.now + 30.0)
    sessions_in_tool_gaps(n, ["s0", "s1", "s2", "s3"], 0.3)
    quiet = sorted(n.d.load._sessions[(s, MODEL)].quiet_at for s in ("s0", "s1", "s2", "s3"))
    assert n.ask("new0") == pytest.approx(quiet[2], abs=1e-3)
    return n, quiet


def test_a_client_late_for_its_place_keeps_it_within_grace_unless_there_is_room_for_both():
    """The head of the line is promised the third departure and not back when it comes. Within
    GRACE_S its place is kept: a newcomer finding room for one session waits behind it. Where the
    room holds both, the newcomer is let in ahead of it, and the head, back within its grace, is
    admitted too."""
    n, quiet = promised_the_third_departure()
    n.at(quiet[2] + 0.1)  # one admitted session is left, charging 1.5 s: room for one more
    assert len(n.d.load.on("hot0").work) == 1
    assert n.ask("newcomer") is not None  # the late head's place is kept: room for one, and it was promised it
    assert [w.session for w in n.d.line.order(MODEL)] == ["new0", "newcomer"]

    n, quiet = promised_the_third_departure()
    n.at(quiet[3] + CONTROL_INTERVAL_S)  # every admitted session gone: room for two
    assert n.clock.now < n.d.line.get("new0").promised_at + GRACE_S
    assert n.ask("newcomer") is None  # room no promise needs: let in ahead of the line
    assert n.ask("new0") is None  # and the head, back within its grace, is in too
    assert len(n.d.line) == 0 and n.d.line.counts["expired"] == 0


def test_places_count_in_full_once_their_client_has_been_back():
    """The share of clients that come back weighs the places of clients not yet seen again; a client
    that has come back once is as good as here, and its place is counted in full."""
    line = AdmissionLine(limit=10)
    for i in range(3):  # three places lost, one taken: a quarter come back
        w = line.join(f"gone{i}", "t", MODEL, 100, 4, 0.0)
        line.promise(w, [1.0] * 3, 0.0)
    line.expire(1.0 + GRACE_S + 0.01)
    line.admitted(line.join("kept", "t", MODEL, 100, 4, 7.0), 7.0)
    assert line.comes_back(MODEL) == 0.25 and line.comes_back("other") == 1.0
    fresh = line.join("fresh", "t", MODEL, 100, 4, 8.0)
    back = line.join("back", "t", MODEL, 100, 4, 8.0)
    fresh.charge_s = back.charge_s = 2.0
    line.returned(back)
    assert line.expected_charges([fresh, back], 1.0) == [0.5, 2.0]
    held = line.join("held", "t", MODEL, 100, 4, 8.0)
    held.held = object()  # its client waits at the gateway
    assert line.expected_charges([held], 1.0) == [1.0]  # no charge of its own yet: the default, in full
