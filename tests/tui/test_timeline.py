"""Round timelines rebuilt from slot_phase, switch, sp_admit and round events, and painted as glyphs."""

from __future__ import annotations

from talaria.contracts.telemetry import RoundState
from talaria.tui.timeline import RoundTimeline, paint
from tests.tui.events import DOC_ROUND, event, switch


def fold(events: list[dict]) -> RoundTimeline:
    timeline = RoundTimeline()
    adders = {"slot_phase": timeline.add_phase, "switch": timeline.add_switch, "sp_admit": timeline.add_admit,
              "round": timeline.add_round}
    for e in events:
        adders[e["kind"]](e)
    return timeline


def round_state(number: int | None, phase: str = "D1", model: str = "b", round_s: float = 2.0) -> RoundState:
    slot = {"model": model, "phase": phase, "budget_s": 1.0, "elapsed_s": 0.3, "protected": 4, "decode_steps": 3,
            "sp_opportunities": 0} if number is not None else None
    return RoundState(number, 0.5, slot, {}, 0, 0, (), round_s)


def test_the_docs_example_round_paints_its_phases_to_scale():
    view = fold(DOC_ROUND).view(now=5.0)
    assert view.closed is not None and view.number == 1
    assert (view.start, view.end, view.budget_s) == (0.0, 1.0, 1.0)  # budget: the slots' budgets, no telemetry
    assert [s.kind for s in view.segments] == ["P", "D1", "SP", "D"]
    # 16 columns of 1/16 s: P 0.1875 s, D1 0.125 s, SP 0.0625 s, D 0.625 s
    assert paint(view, 16) == "PPPDDSDDDDDDDDDD"
    assert [a["session"] for a in view.admits] == ["s1"]


def test_an_open_round_starts_with_its_switch_and_ends_in_the_slots_current_phase():
    timeline = fold(DOC_ROUND + [
        switch(7, 1.2, "partial", 50.0, "a", "b", "inst0"),
        event("slot_phase", 8, 1.3, "inst0", model="b", phase="P", round=2, start=1.2, duration_s=0.1, steps=1,
              tokens=9),
        event("slot_phase", 9, 1.5, "inst0", model="b", phase="D1", round=2, start=1.3, duration_s=0.2, steps=4,
              tokens=4),
    ])
    timeline.observe(round_state(2, "D1"), t=1.6)
    view = timeline.view(now=1.7)
    assert view.closed is None and view.number == 2
    assert (view.start, view.end, view.budget_s) == (1.15, 1.7, 2.0)
    assert [(s.kind, s.start, s.end) for s in view.segments][-1] == ("D1", 1.5, 1.7)  # from telemetry
    assert view.slot["phase"] == "D1"
    # 0.05 s a column: switch 1, P 2, D1 4 reported + 4 in progress; 0.55 s elapsed of a 2 s budget
    assert paint(view, 40) == "~PP" + "D" * 8 + "░" * 29


def test_a_stale_snapshot_adds_no_current_phase():
    timeline = fold([event("slot_phase", 1, 1.3, model="b", phase="P", round=2, start=1.2, duration_s=0.1, steps=1,
                           tokens=9)])
    timeline.observe(round_state(2, "D1"), t=1.25)  # taken before the P record's end
    view = timeline.view(now=1.4)
    assert [s.kind for s in view.segments] == ["P"] and view.slot is None
    assert paint(view, 20) == "P·" + "░" * 18  # 0.1 s a column: P, then 0.1 s nothing has reported yet


def test_a_one_ms_switch_before_a_short_prefill_stays_visible():
    timeline = fold([switch(1, 10.001, "full_d2d", 1.0),
                     event("slot_phase", 2, 10.011, model="tiny-qwen3", phase="P", round=1, start=10.001,
                           duration_s=0.01, steps=1, tokens=8)])
    timeline.observe(round_state(1, round_s=1.6), t=10.0)
    view = timeline.view(now=10.011)
    assert paint(view, 16) == "~P" + "░" * 14  # 0.1 s a column: both shorter than one


def test_a_forced_switch_between_rounds_belongs_to_neither():
    timeline = fold(DOC_ROUND + [switch(7, 3.0, "h2d_only", 10.0, "a", "b", "inst0")])
    last = timeline.view(now=3.5)
    assert last.number == 1 and [s.kind for s in last.segments] == ["P", "D1", "SP", "D"]
    timeline.add_phase(event("slot_phase", 8, 10.1, "inst0", model="b", phase="P", round=2, start=10.0,
                             duration_s=0.1, steps=1, tokens=9))
    opened = timeline.view(now=10.2)
    assert opened.number == 2 and opened.start == 10.0 and [s.kind for s in opened.segments] == ["P"]


def test_telemetry_round_summaries_fill_rounds_the_dashboard_never_saw():
    timeline = RoundTimeline()
    summary = {k: v for k, v in DOC_ROUND[-1].items() if k not in ("seq", "t", "instance", "kind")}
    timeline.observe(RoundState(None, 0.0, None, {}, 1, 0, (summary,), 1.6), t=2.0)
    view = timeline.view(now=2.0)
    assert view.number == 1 and view.closed.sp_admitted == 1 and view.budget_s == 1.6


def test_an_open_round_without_reported_phases_shows_the_last_closed_one():
    timeline = fold(DOC_ROUND)
    timeline.observe(round_state(2), t=1.1)
    assert timeline.view(now=1.2).number == 1
    assert RoundTimeline().view(now=1.0) is None


def test_a_restarted_instance_counting_rounds_from_one_again_is_followed():
    timeline = fold(DOC_ROUND)
    timeline.add_phase(event("slot_phase", 7, 20.1, "inst0", model="a", phase="P", round=1, start=20.0,
                             duration_s=0.1, steps=1, tokens=9))
    view = timeline.view(now=20.2)
    assert (view.number, view.closed, view.start) == (1, None, 20.0)
    assert [s.start for s in view.segments] == [20.0]
