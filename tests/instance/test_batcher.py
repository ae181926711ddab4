"""Batcher bookkeeping on a toy pool (8 pages of 4 tokens): exact step plans, no model.

Each test plays the runner by hand: it takes the plan, chooses the "sampled" token of every chunk
that samples, and commits. Page ids follow the PageManager's policy (the lowest page caching
nothing first, then cached pages least recently freed first, a sequence's tail before its head), so
every page table below is exact.
"""

from __future__ import annotations

from collections import deque

import pytest

from talaria.contracts.call import FinishReason, InstanceCall, SamplingParams
from talaria.contracts.step_plan import SeqChunk, StepPlan
from talaria.instance.batcher import Batcher
from talaria.instance.sequence import OutputLengths, SeqStatus, Sequence
from talaria.memory.page_manager import PageManager

EOS = 2
PS = 4


def batcher(num_pages: int = 8, max_batch_tokens: int = 32, max_running: int = 8, max_context: int = 64) -> Batcher:
    return Batcher("m", PageManager(num_pages, PS), max_batch_tokens, max_running, max_context, (EOS,))


def seq(seq_id: int, prompt, **sampling) -> Sequence:
    call = InstanceCall(f"r{seq_id}", "m", tuple(prompt), SamplingParams(**sampling))
    return Sequence(seq_id, call, list(prompt), 0.0)


def prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def step(b: Batcher, seqs: list[Sequence], sampled: dict[int, int], now: float = 0.0) -> StepPlan:
    """Plan one step and commit it with `sampled`; returns the plan."""
    plan = b.plan(now)
    assert plan is not None
    b.commit(plan, sampled, {s.seq_id: s for s in seqs})
    return plan


def plan_of(*chunks: SeqChunk) -> StepPlan:
    return StepPlan("m", chunks)


# ---- admission and decoding ------------------------------------------------------------------------


def test_single_prompt_is_admitted_then_decoded_growing_a_page_at_the_boundary():
    b = batcher()
    p = prompt(10, 5)
    a = seq(0, p)
    b.add(a)
    assert step(b, [a], {0: 20}, now=3.0) == plan_of(SeqChunk(0, tuple(p), 0, (0, 1), True))
    assert (a.status, a.first_scheduled, a.num_computed, a.token_ids) == (SeqStatus.RUNNING, 3.0, 5, p + [20])
    assert step(b, [a], {0: 21}) == plan_of(SeqChunk(0, (20,), 5, (0, 1), True, decode=True))
    assert step(b, [a], {0: 22}) == plan_of(SeqChunk(0, (21,), 6, (0, 1), True, decode=True))
    assert step(b, [a], {0: 23}) == plan_of(SeqChunk(0, (22,), 7, (0, 1), True, decode=True))
    # 9 tokens no longer fit two pages: the next decode takes page 2
    assert step(b, [a], {0: 24}) == plan_of(SeqChunk(0, (23,), 8, (0, 1, 2), True, decode=True))
    assert a.token_ids == p + [20, 21, 22, 23, 24]
    assert a.finish is None and b.pages.num_free == 5
    # both full computed pages are published under the sequence's hash chain
    assert b.pages.match_prefix(b.pages.extend_chain([], a.token_ids)) == [0, 1]


def test_two_prompts_are_admitted_in_fifo_order_within_the_token_budget():
    b = batcher(max_batch_tokens=16)
    pa, pb, pc = prompt(10, 6), prompt(30, 5), prompt(50, 8)
    a, bb, c = seq(0, pa), seq(1, pb), seq(2, pc)
    for s in (a, bb, c):
        b.add(s)
    assert b.plan(0.0) == plan_of(
        SeqChunk(0, tuple(pa), 0, (0, 1), True),
        SeqChunk(1, tuple(pb), 0, (2, 3), True),
        SeqChunk(2, tuple(pc[:5]), 0, (4, 5), False),  # the budget's last 5 tokens: a first chunk
    )
    assert b.running == [a, bb, c] and not b.waiting


def test_long_prompt_is_chunked_while_a_running_sequence_decodes_every_step():
    b = batcher(max_batch_tokens=6)
    pa, pl = prompt(10, 3), prompt(100, 13)
    a, long = seq(0, pa), seq(1, pl)
    seqs = [a, long]
    b.add(a)
    assert step(b, seqs, {0: 50}) == plan_of(SeqChunk(0, tuple(pa), 0, (0,), True))
    b.add(long)
    assert step(b, seqs, {0: 51}) == plan_of(
        SeqChunk(0, (50,), 3, (0,), True, decode=True),
        SeqChunk(1, tuple(pl[0:5]), 0, (1, 2, 3, 4), False),
    )
    assert step(b, seqs, {0: 52}) == plan_of(
        SeqChunk(0, (51,), 4, (0, 5), True, decode=True),  # decode first, even though it needs a new page
        SeqChunk(1, tuple(pl[5:10]), 5, (1, 2, 3, 4), False),
    )
    assert step(b, seqs, {0: 53, 1: 60}) == plan_of(
        SeqChunk(0, (52,), 5, (0, 5), True, decode=True),
        SeqChunk(1, tuple(pl[10:13]), 10, (1, 2, 3, 4), True),
    )
    assert step(b, seqs, {0: 54, 1: 61}) == plan_of(
        SeqChunk(0, (53,), 6, (0, 5), True, decode=True),
        SeqChunk(1, (60,), 13, (1, 2, 3, 4), True, decode=True),
    )
    assert long.token_ids == pl + [60, 61]


def test_admission_is_head_of_line_blocked_when_pages_are_short():
    b = batcher()
    pa, pb, pc = prompt(10, 20), prompt(40, 16), prompt(70, 2)
    a, bb, c = seq(0, pa, max_tokens=1), seq(1, pb), seq(2, pc)
    for s in (a, bb, c):
        b.add(s)
    # a takes 5 of 8 pages; b needs 4, and c (1 page, it would fit) waits behind b
    plan = b.plan(0.0)
    assert plan == plan_of(SeqChunk(0, tuple(pa), 0, (0, 1, 2, 3, 4), True))
    assert list(b.waiting) == [bb, c] and b.pages.num_free == 3
    assert (bb.status, bb.page_table, c.status, c.page_table) == (SeqStatus.WAITING, [], SeqStatus.WAITING, [])
    b.commit(plan, {0: 99}, {0: a})
    assert a.finish is FinishReason.LENGTH  # max_tokens=1: a's pages are released, still cached
    assert b.plan(0.0) == plan_of(
        SeqChunk(1, tuple(pb), 0, (5, 6, 7, 4), True),  # every clean page, then a's tail
        SeqChunk(2, tuple(pc), 0, (3,), True),
    )
    assert b.pages.match_prefix(b.pages.extend_chain([], pa)) == [0, 1, 2]


def test_admission_stops_at_max_running():
    b = batcher(max_running=1)
    a, bb = seq(0, prompt(10, 3)), seq(1, prompt(20, 3))
    b.add(a)
    b.add(bb)
    assert b.plan(0.0) == plan_of(SeqChunk(0, (10, 11, 12), 0, (0,), True))
    assert list(b.waiting) == [bb]


# ---- preemption -------------------------------------------------------------------------------------


def test_preemption_picks_the_newest_running_sequence_and_requeues_it_first():
    b = batcher()
    pa, pb, pc, pd = prompt(10, 4), prompt(20, 10), prompt(40, 16), prompt(70, 2)
    a, bb, c, d = seq(0, pa), seq(1, pb), seq(2, pc), seq(3, pd)
    seqs = [a, bb, c, d]
    for s in (a, bb, c):
        b.add(s)
    assert step(b, seqs, {0: 100, 1: 200, 2: 300}) == plan_of(
        SeqChunk(0, tuple(pa), 0, (0,), True),
        SeqChunk(1, tuple(pb), 0, (1, 2, 3), True),
        SeqChunk(2, tuple(pc), 0, (4, 5, 6, 7), True),
    )
    assert b.pages.num_free == 0
    b.add(d)
    # a needs a fifth slot, no page is free: c (newest) is preempted, not b; its tail page 7 goes to a
    assert b.plan(0.0) == plan_of(
        SeqChunk(0, (100,), 4, (0, 7), True, decode=True),
        SeqChunk(1, (200,), 10, (1, 2, 3), True, decode=True),
    )
    assert b.preemptions == 1
    assert b.running == [a, bb]
    assert list(b.waiting) == [c, d]  # c holds the queue ahead of d, which would fit
    assert (c.status, c.page_table, c.num_computed) == (SeqStatus.WAITING, [], 0)
    assert c.token_ids == pc + [300]  # its generated token is kept


def test_readmission_after_preemption_recomputes_generated_tokens_from_the_prefix_cache():
    b = batcher()
    pa, pb, pc, pd = prompt(10, 4), prompt(20, 10), prompt(40, 16), prompt(70, 2)
    a, bb, c, d = seq(0, pa), seq(1, pb), seq(2, pc), seq(3, pd)
    seqs = [a, bb, c, d]
    for s in (a, bb, c):
        b.add(s)
    step(b, seqs, {0: 100, 1: 200, 2: 300})
    b.add(d)
    step(b, seqs, {0: EOS, 1: 201})  # c preempted; a finishes and frees pages 0 and 7
    assert a.finish is FinishReason.STOP
    # c's pages 4, 5, 6 are still cached (7 was evicted for a): 12 tokens are reused, and
    # the rest of its prompt plus its generated token are recomputed into pages 7 and 0
    plan = b.plan(0.0)
    assert plan == plan_of(
        SeqChunk(1, (201,), 11, (1, 2, 3), True, decode=True),
        SeqChunk(2, tuple(pc[12:]) + (300,), 12, (4, 5, 6, 7, 0), True,
                 prefix=(40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51)),  # pc[:12], reused
    )
    assert plan.chunks[0].prefix == ()  # bb's decode admits nothing: no prefix
    assert c.num_computed == 12
    assert c.num_cached == 0 and b.prefix_hit_tokens == 0  # cached tokens count on first admission only
    assert list(b.waiting) == [d]


def test_a_decode_preempts_itself_when_every_other_sequence_is_already_planned():
    b = batcher(num_pages=3)
    pa, pb = prompt(10, 3), prompt(20, 8)
    a, bb = seq(0, pa), seq(1, pb)
    b.add(a)
    b.add(bb)
    step(b, [a, bb], {0: 100, 1: 200})
    # a decodes within page 0; bb (newest) needs a third page, none is free and a is planned
    assert b.plan(0.0) == plan_of(SeqChunk(0, (100,), 3, (0,), True, decode=True))
    assert b.running == [a] and list(b.waiting) == [bb] and b.preemptions == 1
    assert (bb.page_table, bb.num_computed, bb.token_ids) == ([], 0, pb + [200])


# ---- prefix hits ------------------------------------------------------------------------------------


def test_prefix_hit_at_admission_sets_num_computed_and_num_cached():
    b = batcher()
    p = prompt(10, 10)
    a = seq(0, p, max_tokens=1)
    b.add(a)
    step(b, [a], {0: 99})  # publishes pages 0 and 1; a finishes and releases 0, 1, 2
    bb = seq(1, p[:8] + [30, 31, 32])
    b.add(bb)
    # pages 0 and 1 are hits; page 2 (partial, never published) is the lowest clean page
    assert b.plan(5.0) == plan_of(
        SeqChunk(1, (30, 31, 32), 8, (0, 1, 2), True, prefix=(10, 11, 12, 13, 14, 15, 16, 17)))
    assert (bb.num_computed, bb.num_cached, b.prefix_hit_tokens) == (8, 8, 8)
    assert b.pages.num_free == 5


def test_a_prompt_whose_prefix_another_is_computing_waits_for_it_and_others_go_past():
    b = batcher(num_pages=16)
    p = prompt(10, 10)
    a, follower, other = seq(0, p), seq(1, p[:8] + [30, 31, 32]), seq(2, prompt(50, 5))
    seqs = [a, follower, other]
    for s in seqs:
        b.add(s)
    # the follower's first two pages are the leader's: it waits; the unrelated prompt behind it does not
    assert step(b, seqs, {0: 99, 2: 98}) == plan_of(SeqChunk(0, tuple(p), 0, (0, 1, 2), True),
                                                     SeqChunk(2, tuple(prompt(50, 5)), 0, (3, 4), True))
    assert b.waiting == deque([follower])
    # the leader's pages are cached now: the follower computes only its own tail
    assert b.plan(0.0) == plan_of(SeqChunk(0, (99,), 10, (0, 1, 2), True, decode=True),
                                  SeqChunk(2, (98,), 5, (3, 4), True, decode=True),
                                  SeqChunk(1, (30, 31, 32), 8, (0, 1, 5), True, prefix=tuple(p[:8])))
    assert (follower.num_cached, b.prefix_hit_tokens) == (8, 8)


def test_a_follower_waits_until_a_chunked_leader_has_cached_the_whole_shared_prefix():
    b = batcher(num_pages=16, max_batch_tokens=8)
    p = prompt(10, 13)
    a, follower = seq(0, p), seq(1, p)
    seqs = [a, follower]
    b.add(a)
    b.add(follower)
    assert step(b, seqs, {}) == plan_of(SeqChunk(0, tuple(p[:8]), 0, (0, 1, 2, 3), False))
    # pages 0 and 1 are cached and 3 tokens of budget are left, but page 2, the follower's next, is
    # still the leader's to compute
    assert step(b, seqs, {0: 99}) == plan_of(SeqChunk(0, tuple(p[8:]), 8, (0, 1, 2, 3), True))
    assert step(b, seqs, {0: 98, 1: 99}) == plan_of(
        SeqChunk(0, (99,), 13, (0, 1, 2, 3), True, decode=True),
        SeqChunk(1, (p[12],), 12, (0, 1, 2, 4), True, prefix=tuple(p[:12])))
    assert follower.num_cached == 12 and follower.token_ids == p + [99]


@pytest.mark.parametrize("pool, later_len", [
    ({"num_pages": 16, "max_running": 2}, 5),  # the second running slot is the follower's
    ({"num_pages": 6}, 8),  # 2 pages free beside the leader's 4: the follower will need 1, the later prompt 2
], ids=["running-slot", "pages"])
def test_a_follower_keeps_its_room_against_prompts_that_arrived_after_it(pool, later_len):
    b = batcher(**pool)
    p = prompt(10, 13)
    leader, follower, later = seq(0, p), seq(1, p[:12] + [40, 41]), seq(2, prompt(60, later_len))
    seqs = [leader, follower, later]
    for s in seqs:
        b.add(s)
    assert step(b, seqs, {0: 99}) == plan_of(SeqChunk(0, tuple(p), 0, (0, 1, 2, 3), True))
    assert b.waiting == deque([follower, later])
    assert step(b, seqs, {0: 98, 1: 97}) == plan_of(
        SeqChunk(0, (99,), 13, (0, 1, 2, 3), True, decode=True),
        SeqChunk(1, (40, 41), 12, (0, 1, 2, 4), True, prefix=tuple(p[:12])))
    assert b.waiting == deque([later]) and b.preemptions == 0


def test_fully_cached_prompt_still_computes_its_last_page():
    b = batcher()
    p = prompt(10, 8)
    a = seq(0, p, max_tokens=1)
    b.add(a)
    step(b, [a], {0: 99})  # publishes pages 0 and 1
    again = seq(1, p)
    b.add(again)
    # both pages are cached, but the step must produce logits for the next token
    assert b.plan(0.0) == plan_of(SeqChunk(1, tuple(p[4:]), 4, (0, 2), True, prefix=(10, 11, 12, 13)))
    assert (again.num_computed, again.num_cached) == (4, 4)


# ---- finishing ---------------------------------------------------------------------------------------


def test_eos_finishes_with_stop_and_releases_pages():
    b = batcher()
    a = seq(0, prompt(10, 5))
    b.add(a)
    step(b, [a], {0: 20})
    step(b, [a], {0: EOS})
    assert a.finish is FinishReason.STOP and a.status is SeqStatus.FINISHED
    assert a.token_ids[-2:] == [20, EOS]
    assert not b.has_work and b.pages.num_free == 8


def test_ignore_eos_keeps_decoding_past_eos():
    b = batcher()
    a = seq(0, prompt(10, 5), ignore_eos=True)
    b.add(a)
    step(b, [a], {0: EOS})
    assert a.finish is None and a.status is SeqStatus.RUNNING
    assert b.plan(0.0) == plan_of(SeqChunk(0, (EOS,), 5, (0, 1), True, decode=True))


def test_stop_token_ids_finish_with_stop_even_with_ignore_eos():
    b = batcher()
    a = seq(0, prompt(10, 5), ignore_eos=True, stop_token_ids=(7,))
    b.add(a)
    step(b, [a], {0: 6})
    assert a.finish is None
    step(b, [a], {0: 7})
    assert a.finish is FinishReason.STOP and not b.has_work


def test_max_tokens_finishes_with_length():
    b = batcher()
    a = seq(0, prompt(10, 5), max_tokens=3)
    b.add(a)
    step(b, [a], {0: 20})
    step(b, [a], {0: 21})
    assert a.finish is None
    step(b, [a], {0: 22})
    assert a.finish is FinishReason.LENGTH and a.num_generated == 3
    assert not b.has_work and b.pages.num_free == 8


def test_context_limit_finishes_with_length():
    b = batcher(max_context=8)
    a = seq(0, prompt(10, 6))
    b.add(a)
    step(b, [a], {0: 20})
    assert a.finish is None
    step(b, [a], {0: 21})
    assert a.finish is FinishReason.LENGTH and len(a.token_ids) == 8
    assert not b.has_work


def test_sequence_that_outgrows_the_whole_pool_finishes_instead_of_waiting_forever():
    # 2 pages of 4 tokens and a model context of 64: after 9 tokens the sequence can never get the
    # KV slot its next decode needs, even with the pool to itself. It must end (LENGTH: the pool is
    # its context limit), not sit preempted at the head of the queue with has_work forever true.
    b = batcher(num_pages=2, max_context=64)
    p = prompt(10, 6)
    a = seq(0, p, max_tokens=10)
    b.add(a)
    for token in (50, 51, 52):
        step(b, [a], {0: token})
    assert a.token_ids == p + [50, 51, 52]
    assert a.finish is FinishReason.LENGTH
    assert not b.has_work


# ---- removal and impossible prompts ------------------------------------------------------------------


def test_remove_of_a_running_sequence_releases_its_pages_and_keeps_them_cached():
    b = batcher()
    p = prompt(10, 9)
    a = seq(0, p)
    b.add(a)
    step(b, [a], {0: 20})
    b.remove(a)
    assert (a.status, a.page_table, b.running) == (SeqStatus.FINISHED, [], [])
    assert b.pages.num_free == 8 and not b.has_work
    assert b.pages.match_prefix(b.pages.extend_chain([], p)) == [0, 1]


def test_remove_of_a_waiting_sequence_leaves_the_queue_and_pages():
    b = batcher()
    pa, pc = prompt(10, 24), prompt(60, 2)
    a, bb, c = seq(0, pa), seq(1, prompt(40, 12)), seq(2, pc)
    for s in (a, bb, c):
        b.add(s)
    step(b, [a, bb, c], {0: 20})
    assert list(b.waiting) == [bb, c] and b.pages.num_free == 2  # bb needs 3 pages
    b.remove(bb)
    assert (bb.status, list(b.waiting), b.pages.num_free) == (SeqStatus.FINISHED, [c], 2)
    assert b.plan(0.0) == plan_of(
        SeqChunk(0, (20,), 24, (0, 1, 2, 3, 4, 5, 6), True, decode=True),
        SeqChunk(2, tuple(pc), 0, (7,), True),
    )


def test_a_prompt_that_could_never_fit_finishes_with_error_at_add():
    b = batcher()
    too_long = seq(0, prompt(10, 32))  # 32 tokens + one to generate need 9 of 8 pages
    b.add(too_long)
    assert (too_long.finish, too_long.status) == (FinishReason.ERROR, SeqStatus.FINISHED)
    assert not b.has_work
    fits = seq(1, prompt(10, 31))
    b.add(fits)
    assert fits.finish is None and list(b.waiting) == [fits]


def test_the_longest_output_expected_of_n_calls_is_the_n_over_n_plus_1_quantile_of_those_seen():
    b = batcher()
    assert b.outputs.longest(4) == 0  # none finished yet
    for tokens in (50, 10, 40, 20, 30):
        b.outputs.add(tokens)
    assert [b.outputs.longest(n) for n in (0, 1, 2, 4, 100)] == [0, 30, 40, 50, 50]
    for _ in range(OutputLengths.KEPT - 4):  # one more than KEPT: the oldest, 50, falls out
        b.outputs.add(1)
    assert b.outputs[-1] == 40 and len(b.outputs) == OutputLengths.KEPT
