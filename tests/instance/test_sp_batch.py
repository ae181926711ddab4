"""SP batch selection: the paper's rule admits every candidate; `pays` admits the shortest-work-first
prefix whose completions brought forward outweigh those it pushes back (talaria/instance/sp_batch.py)."""

from __future__ import annotations

from talaria.instance.sp_batch import SpOpportunity, paper, pays, share

WORK = {"a": 0.3, "b": 0.1, "c": 0.2}  # seconds of restore + tail prefill per candidate
STEP = 0.01  # one decode step


def chosen(candidates=("a", "b", "c"), *, fixed_s=2.0, left_s=10.0, later_s=10.0, generated=(0, 0, 0, 0),
           outputs=(100,) * 10) -> list[str]:
    o = SpOpportunity(fixed_s, left_s, later_s, STEP, tuple(generated), sorted(outputs))
    return pays(list(candidates), WORK.__getitem__, lambda: o)


def test_the_paper_admits_every_candidate_in_arrival_order_without_pricing_them():
    def unpriced(_):
        raise AssertionError("the paper's rule never prices a candidate")

    assert paper(["a", "b", "c"], unpriced, unpriced) == ["a", "b", "c"]


def test_share_is_the_chance_a_call_that_has_generated_so_much_ends_in_a_window():
    outputs = [100, 200, 300, 400]
    assert share(outputs, 150, 0, 100) == 1 / 3  # of 200, 300, 400 only 200 ends within 100 more tokens
    assert share(outputs, 0, 0, 250) == 1 / 2
    assert share(outputs, 500, 0, 1e9) == 0.0  # longer than anything seen: no prediction


def test_early_in_a_round_every_candidate_is_admitted_shortest_work_first():
    # each completes in the slot (2.6 s + 1 s of decode <= 10 s) instead of waiting ~20 s for the next P;
    # the four decoders wait 2.6 s each and none is pushed past the slot's end
    assert chosen() == ["b", "c", "a"]


def test_a_fixed_cost_one_continuation_cannot_pay_waits_for_the_next_p():
    # the round's last slot, 4 s left: the next P comes in 4 s; the step would hold 4 decoders 2.1 s each
    assert chosen(("b",), left_s=4.0, later_s=0.0) == []
    assert chosen(("b",), fixed_s=0.005, left_s=4.0, later_s=0.0) == ["b"]  # a small fixed cost pays


def test_a_decoder_the_step_would_push_past_the_slots_end_costs_it_the_rest_of_the_round():
    # 1 s left: a decoder 95 tokens from its end finishes at 0.95 s, or at 1.1 s, after the slot, with the step
    assert chosen(("b",), fixed_s=0.05, left_s=1.0, later_s=20.0, generated=(0,), outputs=(95,) * 4) == []
    assert chosen(("b",), fixed_s=0.05, left_s=1.0, later_s=20.0, generated=(0,), outputs=(50,) * 4) == ["b"]


def test_with_nothing_decoding_the_slot_would_end_now():
    assert chosen(generated=()) == ["b", "c", "a"]  # the model's next P is a whole round away
    assert chosen(generated=(), later_s=0.0) == []  # the round's last slot: the next P is now
