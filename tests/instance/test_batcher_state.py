"""The batcher, page manager and host KV registry with a stateful cache layout: exact plans.

The layout is built here, as a hybrid model's would be: per-token `k` and `v` on layers 1 and 3,
a per-sequence `ssm` state on layers 0 and 2. Such a cache resumes only where a state snapshot was
published (`KVLayout.resume_pages`): every test asserts the positions a sequence resumes at and the
state ops (copies, zeroing, host restores) a step carries, with a toy pool of 16 pages of 4 tokens,
4 state slots and a host registry of 16 page slabs and 4 state slabs.
"""

from __future__ import annotations

from talaria.contracts.call import InstanceCall, SamplingParams
from talaria.contracts.kv_layout import CacheTensor, KVLayout
from talaria.contracts.step_plan import SaveOp, SeqChunk
from talaria.instance.batcher import Batcher
from talaria.instance.sequence import SeqStatus, Sequence
from talaria.memory.host_kv_registry import HostKVRegistry, Kind, SaveEntry
from talaria.memory.page_manager import PageManager

PS = 4
EOS = 2
LAYOUT = KVLayout(PS, (CacheTensor("k", (1, 3), (2, 4), "float32", True),
                       CacheTensor("v", (1, 3), (2, 4), "float32", True),
                       CacheTensor("ssm", (0, 2), (2, 4, 4), "float32", False)))


def pool(pages: int = 16, slots: int = 4) -> PageManager:
    return PageManager(pages, PS, layout=LAYOUT, state_slots=slots)


def host() -> HostKVRegistry:
    return HostKVRegistry(16, LAYOUT.page_bytes, 4, LAYOUT.state_bytes, {"m": LAYOUT})


def batcher(pages: PageManager | None = None, reg: HostKVRegistry | None = None, budget: int = 32,
            max_running: int = 2) -> Batcher:
    return Batcher("m", pages or pool(), budget, max_running, 256, (EOS,), reg)


def seq(seq_id: int, prompt: list[int], max_tokens: int = 16) -> Sequence:
    call = InstanceCall(f"r{seq_id}", "m", tuple(prompt), SamplingParams(max_tokens=max_tokens))
    return Sequence(seq_id, call, list(prompt), 0.0)


def step(b: Batcher, seqs: list[Sequence], sampled: dict[int, int] | None = None) -> tuple:
    """Plan one step, take its state ops (as the memory planner does), commit it with `sampled` (or
    token 50 + seq_id for every chunk that samples) and finish it; returns (chunks, state ops)."""
    plan = b.plan(0.0)
    ops = drain_states(b)
    by_id = {q.seq_id: q for q in seqs}
    tokens = sampled if sampled is not None else {c.seq_id: 50 + c.seq_id for c in plan.chunks if c.sample}
    b.commit(plan, tokens, by_id)
    b.step_done()
    return plan.chunks, ops


def spans(chunks) -> list[tuple[int, int, int]]:
    """(seq_id, start, tokens) of each chunk."""
    return [(c.seq_id, c.start_pos, len(c.token_ids)) for c in chunks]


def drain_states(b: Batcher) -> tuple[list, list, list]:
    """The state ops decided since the last drain, as the memory planner takes them."""
    return tuple(list(part) for part in b.states.drain())


def agree_saves(b: Batcher, reg: HostKVRegistry, agreed: int | None = None) -> list[SaveOp]:
    """Finish every host save the batcher decided, publishing `agreed` pages (default: all)."""
    saves, b.saves = b.saves, []
    for s in saves:
        ticket = reg.ticket(s.ticket)
        reg.finish_save(ticket, agreed if agreed is not None else len(ticket.entries))
        b.saved(s.ticket)
    return saves


def test_the_layout_places_tokens_in_pages_and_states_in_slots():
    assert LAYOUT.page_bytes == 2 * 2 * PS * 2 * 4 * 4  # k and v, 2 layers, 4 tokens of 2x4 fp32
    assert LAYOUT.state_bytes == 2 * 2 * 4 * 4 * 4  # ssm on 2 layers, 2x4x4 fp32
    assert LAYOUT.offsets == {("ssm", 0): 0, ("k", 1): 0, ("v", 1): 128, ("ssm", 2): 128, ("k", 3): 256,
                              ("v", 3): 384}
    assert LAYOUT.stateful and LAYOUT.resume_pages(5, lambda n: n in (1, 3)) == 3
    assert LAYOUT.resume_pages(5, lambda n: False) == 0


def test_prompt_chunks_end_on_page_boundaries_before_the_newest_token_and_each_publishes_a_snapshot():
    b = batcher(budget=6)
    a = seq(0, list(range(10, 24)))  # 14 tokens, 6 a step
    b.add(a)
    chunks, ops = step(b, [a])
    assert chunks == (SeqChunk(0, tuple(range(10, 14)), 0, (0, 1, 2, 3), False, (), False, 0, 0),)
    assert ops == ([], [0], [])  # it starts from its first token: its live slot 0 is zeroed
    chunks, ops = step(b, [a])  # 6 tokens would end mid-page: 4; the snapshot after page 0 is copied first
    assert (spans(chunks), ops) == ([(0, 4, 4)], ([(0, 1)], [], []))
    chunks, ops = step(b, [a])
    assert (spans(chunks), ops) == ([(0, 8, 4)], ([(0, 2)], [], []))
    chunks, ops = step(b, [a])  # the last 2: 14 is no boundary, but 12, before the newest token, was
    assert (spans(chunks), chunks[0].sample, ops) == ([(0, 12, 2)], True, ([(0, 3)], [], []))
    chain = b.pages.extend_chain([], a.token_ids)
    assert [b.pages.snapshot(h) for h in chain] == [1, 2, 3]


def test_a_prefix_hit_resumes_only_at_a_published_snapshot():
    b = batcher(budget=32)
    a = seq(0, list(range(10, 20)), max_tokens=3)  # 10 tokens
    b.add(a)
    # [0, 8) then [8, 10): a snapshot at 8, the prompt's last boundary; decoding reaches 12: another
    plans = [spans(step(b, [a])[0]) for _ in range(4)]
    assert plans == [[(0, 0, 8)], [(0, 8, 2)], [(0, 10, 1)], [(0, 11, 1)]]
    assert a.status is SeqStatus.FINISHED and a.num_computed == 12 and a.token_ids[10:] == [50, 50, 50]
    chain = b.pages.extend_chain([], a.token_ids)
    assert [b.pages.snapshot(h) for h in chain] == [None, 1, 2]
    drain_states(b)
    # the same 12 tokens and more: pages 0..2 are cached and a snapshot follows page 2: resume at 12
    c = seq(1, a.token_ids[:12] + [60, 61, 62])
    b.add(c)
    chunks, ops = step(b, [c])
    assert (c.num_cached, spans(chunks), ops) == (12, [(1, 12, 3)], ([(2, 0)], [], []))  # snapshot 2 -> live 0
    # its first 4 tokens only: page 0 is cached, but no snapshot follows it: from the first token
    d = seq(2, a.token_ids[:4] + [80, 81, 82, 83, 84])
    b.add(d)
    chunks, ops = step(b, [c, d])
    assert d.num_cached == 0 and (2, 0, 8) in spans(chunks) and ops[1] == [d.state_slot]


def finish(b: Batcher, seqs: list[Sequence]) -> None:
    while any(q.status is not SeqStatus.FINISHED for q in seqs):
        step(b, seqs)


def test_release_saves_the_latest_snapshot_with_the_pages_and_a_host_return_restores_both():
    reg = host()
    b = batcher(reg=reg)
    a = seq(0, list(range(10, 20)), max_tokens=3)
    b.add(a)
    finish(b, [a])
    snapshot = b.pages.snapshot(b.pages.extend_chain([], a.token_ids)[2])  # after page 2, at 12
    (save,) = agree_saves(b, reg)
    assert save.copies == ((0, 0), (1, 1), (2, 2)) and save.states == ((snapshot, 0),)
    assert (reg.stats().published, reg.stats().states_used, reg.stats().in_flight) == (4, 1, 0)
    # a switch away and back: a fresh device pool, the host holds pages 0..2 and the state after page 2
    b.resume(pool())
    drain_states(b)
    c = seq(1, a.token_ids[:12] + [60, 61])
    b.add(c)
    chunks, ops = step(b, [c])
    assert (c.num_cached, c.num_restored, spans(chunks)) == (12, 12, [(1, 12, 2)])
    assert ops == ([], [], [(0, 0)])  # state slab 0 -> c's live slot 0


def test_taking_a_state_slot_fails_cleanly_when_every_slot_is_live_or_being_copied():
    b = batcher(budget=32, max_running=4, pages=pool(slots=2))
    a = seq(0, list(range(10, 19)), max_tokens=1)
    b.add(a)
    finish(b, [a])  # a snapshot after page 1 (slot 1), a's live slot 0 free again
    drain_states(b)
    c, d = seq(1, a.token_ids[:8] + [60]), seq(2, [70, 71])
    b.add(c)
    b.add(d)
    chunks, ops = b.plan(0.0).chunks, drain_states(b)  # c loads the snapshot: it is pinned until the step ran
    assert spans(chunks) == [(1, 8, 1)] and ops == ([(1, 0)], [], []) and d.status is SeqStatus.WAITING
    assert b.pages.states_free == 0  # c's live slot 0, the pinned snapshot 1: d waits, nothing changed
    b.step_done()
    assert b.pages.states_free == 1 and b.pages.snapshot(b.pages.extend_chain([], a.token_ids)[1]) == 1


def test_a_cancelled_running_sequence_returns_its_slot_and_saves_its_snapshot():
    reg = host()
    b = batcher(reg=reg)
    a = seq(0, list(range(10, 22)))  # 12 tokens: [0, 8), then [8, 12), sampling: snapshots at 8 and 12
    b.add(a)
    step(b, [a])
    step(b, [a])
    b.remove(a)  # the client went away before its first decode: the latest snapshot goes to host
    (save,) = agree_saves(b, reg)
    assert a.state_slot == -1 and save.states == ((2, 0),) and b.pages.states_free == 4
    assert reg.resumable("m", b.pages.extend_chain([], a.token_ids)) == 3


def test_a_state_is_never_published_above_the_agreed_page():
    reg = host()
    chain = [101, 102, 103]
    ticket = reg.begin_save("m", chain, state_after=3)
    assert ticket.entries[-1] == SaveEntry(2, 103, 0, Kind.STATE)
    reg.finish_save(ticket, 2)  # one rank vouches for two pages only: the state after page 3 stays hidden
    assert (reg.peek("m", chain), reg.state("m", 103), reg.resumable("m", chain)) == ([0, 1], None, 0)
    ticket = reg.begin_save("m", chain[:2], state_after=2)
    reg.finish_save(ticket, 2)
    assert reg.state("m", 102) == 0 and reg.resumable("m", chain) == 2  # the dropped state's slab, again
    # a state is reserved only with every page before it present: here the pages are in flight first
    ticket = reg.begin_save("m", [201, 202], state_after=2)
    assert ticket.entries == (SaveEntry(0, 201, 2), SaveEntry(1, 202, 3), SaveEntry(1, 202, 1, Kind.STATE))
    reg.abort_save(ticket)
    full = HostKVRegistry(1, 8, 1, 8, {"m": LAYOUT})  # room for one page: the state after two is useless
    assert full.begin_save("m", [201, 202], state_after=2).entries == (SaveEntry(0, 201, 0),)
    assert (reg.stats().states_used, full.stats().states_used) == (1, 0)


def test_host_state_eviction_is_least_recently_used_and_spares_pinned_slabs():
    reg = HostKVRegistry(16, 8, 2, 8, {"m": LAYOUT})
    for h in (1, 2):
        reg.finish_save(reg.begin_save("m", [h], state_after=1), 1)
    reg.pin([reg.state("m", 1)], Kind.STATE)  # being restored
    reg.finish_save(reg.begin_save("m", [3], state_after=1), 1)
    assert (reg.state("m", 1), reg.state("m", 2), reg.state("m", 3)) == (0, None, 1)
    assert reg.resumable("m", [2]) == 0 and reg.resumable("m", [3]) == 1


def test_preemption_frees_the_live_slot_and_readmission_resumes_at_the_latest_snapshot():
    reg = host()
    b = batcher(pool(pages=4), reg, max_running=2)
    a, c = seq(0, list(range(10, 17)), max_tokens=16), seq(1, list(range(30, 37)), max_tokens=16)
    b.add(a)
    b.add(c)
    assert [spans(step(b, [a, c])[0]) for _ in range(3)] == [  # prompts of 7 in [0, 4) and [4, 7); a decode
        [(0, 0, 4), (1, 0, 4)], [(0, 4, 3), (1, 4, 3)], [(0, 7, 1), (1, 7, 1)]]
    assert drain_states(b)[0] == [(0, 2), (1, 3)]  # at 8: snapshots after page 1 (evicting those after page 0)
    assert b.plan(0.0) is None  # a needs a third page: c, the newest, is preempted; its pages are
    assert c.status is SeqStatus.WAITING and c.state_slot == -1  # pinned while saved with its snapshot
    (save,) = agree_saves(b, reg)
    assert (save.seq_id, save.copies, save.states) == (1, ((2, 0), (3, 1)), ((3, 0),))
    chunks, _ = step(b, [a, c])  # a takes c's tail page (evicted: the least recently freed), c waits
    assert [(ch.seq_id, ch.page_table) for ch in chunks] == [(0, (0, 1, 3))]
    b.remove(a)
    assert agree_saves(b, reg)[0].states == ((2, 1),)  # a's snapshot after its page 1 goes to host too
    # c comes back at 8: page 0 of its prefix from the device, page 1 from host slab 1, its state
    # from the device snapshot (slot 3), which a host state would back up
    plan = b.plan(0.0)
    assert (c.num_computed, spans(plan.chunks), plan.chunks[0].token_ids) == (8, [(1, 8, 1)], (51,))
    assert (c.page_table, b.restores, drain_states(b)) == ([2, 3, 1], [(1, 3)], ([(3, 0)], [], []))


def test_a_prompt_sharing_a_running_prompts_prefix_does_not_wait_for_it():
    """A follower could resume only at the chunk ends of its leader, which are not where it
    diverges: a stateful model's prompts are admitted past one another."""
    b = batcher(budget=32)
    shared = list(range(10, 22))
    a, f = seq(0, shared + [90, 91]), seq(1, shared + [95])
    b.add(a)
    b.add(f)
    chunks, _ = step(b, [a, f])
    assert spans(chunks) == [(0, 0, 12), (1, 0, 12)]


def test_memory_ops_carry_the_state_ops_and_a_switch_takes_pending_snapshots_before_its_saves():
    from talaria.instance.memory_planner import MemoryPlanner
    from talaria.memory.bump_layout import BumpLayout
    from tests.instance.copy_events import CopyEventsStandIn

    arena = BumpLayout(1 << 16, 256)
    for m in ("m", "n"):
        arena.register(m, 1024, LAYOUT, LAYOUT.state_slots(2))
    plan = arena.plan("m")
    assert (plan.num_state_slots, plan.states.start, plan.states.end) == (4, 1024, 1024 + 4 * LAYOUT.state_bytes)
    assert plan.kv.start == plan.states.end  # pages, and so staging, start above the state slots
    reg = host()
    memory = MemoryPlanner(arena, {"m": 1024, "n": 1024}, PS, reg, None, False, CopyEventsStandIn(),
                           {"m": LAYOUT, "n": LAYOUT})
    b = batcher(reg=reg)
    b.resume(memory.new_pool("m"))
    assert b.pages.num_state_slots == 4
    a = seq(0, list(range(10, 17)), max_tokens=8)
    b.add(a)
    chunks, ops = [], []
    for _ in range(3):  # [0, 4), [4, 7), a decode reaching 8
        plan = b.plan(0.0)
        chunks.append(spans(plan.chunks))
        ops.append(memory.ops(b))
        b.commit(plan, {0: 50}, {0: a})
        b.step_done()
    assert chunks == [[(0, 0, 4)], [(0, 4, 3)], [(0, 7, 1)]]
    assert (ops[0].state_zero, ops[1].state_copies, ops[2].state_copies) == ((0,), ((0, 1),), ())
    b.suspend()  # a switch away: a is preempted and saved with the snapshot after page 1 (8 tokens)
    switch = memory.switch_plan("n", b)
    assert switch.ops.state_copies == ((0, 2),)  # taken before the save that reads it
    assert switch.ops.saves[0].states == ((2, 0),) and switch.ops.saves[0].copies == ((0, 0), (1, 1))
    assert memory.ops(b).state_copies == ()


def test_long_prompts_publish_snapshots_at_the_configured_spacing_for_branching_calls():
    b = Batcher("m", pool(), 32, 2, 256, (EOS,), None, snapshot_every=8)
    a = seq(0, list(range(10, 30)))  # 20 tokens: chunks end at 8 and 16 (not only at 16, the last boundary)
    b.add(a)
    assert [spans(step(b, [a])[0]) for _ in range(3)] == [[(0, 0, 8)], [(0, 8, 8)], [(0, 16, 4)]]
    branch = seq(1, a.token_ids[:12] + [90, 91, 92])  # shares 12 tokens: resumes at the snapshot at 8
    b.add(branch)
    chunks, _ = step(b, [a, branch])
    assert branch.num_cached == 8 and (1, 8, 4) in spans(chunks)  # to 12, its last boundary: a snapshot too


def test_the_default_snapshot_spacing_costs_five_percent_of_the_prefill_by_the_profile():
    from talaria.config.schema import InstanceConfig, Pool
    from talaria.contracts.profile import DecodeCurve, ModelProfile, PrefillCurve
    from talaria.instance.assembly import snapshot_spacing

    priced = ModelProfile("m", 1, 64, PrefillCurve(2.775e-3, 4.0e-5), DecodeCurve(1e-3, 1e-4), {}, state_bytes=1)
    config = InstanceConfig(name="c", pool=Pool.COLD, models=("m",), page_size=16)
    # one more step's 2.775 ms per 1,388 tokens of 40 us: 5 %, rounded up to whole pages
    assert snapshot_spacing(config, LAYOUT, priced) == 1392
    assert snapshot_spacing(InstanceConfig(name="c", pool=Pool.COLD, models=("m",), page_size=16,
                                           snapshot_every_tokens=1000),
                            LAYOUT, priced) == 1008
