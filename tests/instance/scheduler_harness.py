"""A scheduler assembled as every instance is (talaria/instance/assembly.py), on an injected clock.

No torch and no engine: a real BumpLayout, HostKVRegistry and MemoryPlanner, Batchers with host
saves, a RoundScheduler with a toy profile whose costs are exact binary fractions, and a RankLedger
standing in for the runners' KV. Tests sample every token themselves and set (or let `drive`
advance) the clock, so every plan, page, slab and timing is exact.

The toy arena (3584 bytes, 256 of runtime, 256-byte pages of 4 tokens) leaves model "a" (1024 bytes
of weights) 8 KV pages, "b" (1280 bytes) 7 pages and "c" (768 bytes) 9 pages; the host registry has
16 slabs. Toy costs: prefill 1/64 s per token, a decode step 1/16 s, a restore 1/256 s per token,
an H2D switch 1/8 s. Rounds: ttft 1.25 s x gamma 0.8 = 1 s; tpot 0.25 s, so 4 protected decode
steps per model per round.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from talaria.config.schema import Ablation, InstanceConfig, Pool
from talaria.contracts.call import CallOutput, InstanceCall, SamplingParams
from talaria.contracts.events import Event
from talaria.contracts.kv_layout import sized_layout
from talaria.contracts.profile import (
    Bandwidth,
    DecodeCurve,
    ModelProfile,
    PrefillCurve,
    Profile,
    SwitchCost,
)
from talaria.contracts.step_plan import MemoryOps, StepPlan, SwitchPlan
from talaria.contracts.vocabulary import SwitchPath
from talaria.instance.assembly import ServedModel, assemble
from talaria.instance.memory_planner import MemoryPlanner
from talaria.instance.rounds import RoundConfig
from talaria.instance.scheduler import Scheduler
from talaria.memory.bump_layout import BumpLayout
from talaria.memory.host_kv_registry import HostKVRegistry, RankReport
from talaria.memory.page_manager import ROOT_HASH, page_hash
from talaria.memory.rank_ledger import RankLedger
from talaria.memory.switch_record import RankSwitchRecord, SwitchRecord
from tests.instance.copy_events import CopyEventsStandIn

PS = 4
PAGE_BYTES = 256
LAYOUT = sized_layout(PS, PAGE_BYTES // PS)  # per-token KV only
WEIGHTS = {"a": 1024, "b": 1280, "c": 768}
PAGES = {"a": 8, "b": 7, "c": 9}  # what the layout leaves each model (checked below)
PROMPT = (10, 11, 12, 13, 14, 15)
PREFILL_S = 1 / 64  # per token
DECODE_S = 1 / 16  # per step
SWITCH_S = 1 / 8  # H2D open
RESTORE_S = 1 / 256  # per token
ROUNDS = RoundConfig(ttft_s=1.25, tpot_s=0.25, gamma=0.8, max_batch_tokens=32, min_chunk_tokens=PS)


def toy_profile(models: Seq[str], prefill_base_s: float = 0.0) -> Profile:
    kv_per_token = PAGE_BYTES // PS
    return Profile("toy", "cpu", 1, 3584, "2026-11-30T00:00:00+00:00", "hand-written for tests",
                   Bandwidth(kv_per_token / RESTORE_S, kv_per_token / RESTORE_S, 1e12),
                   {m: ModelProfile(m, WEIGHTS[m], kv_per_token, PrefillCurve(prefill_base_s, PREFILL_S),
                                    DecodeCurve(DECODE_S, 0.0), {SwitchPath.H2D_ONLY: SwitchCost(SwitchPath.H2D_ONLY, (0, SWITCH_S, 0, 0, 0))})
                    for m in models})


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Instance:
    """An assembled scheduler, plus a one-rank stand-in for the runners."""

    scheduler: Scheduler
    memory: MemoryPlanner
    host: HostKVRegistry
    events: CopyEventsStandIn
    clock: FakeClock
    ledger: RankLedger  # what the (single) runner rank has written into its KV, per sequence
    events_seen: list[Event] = field(default_factory=list)

    def reports(self, agree: Seq[tuple[int, int]]) -> list[list[RankReport]]:
        return [[self.ledger.report(seq_id) for _, seq_id in agree]]

    def run(self, plan: StepPlan | SwitchPlan, token: int = 50, step_s: float = 0.0) -> list[CallOutput]:
        """Run `plan` as the engine group would; every sampling chunk draws `token`."""
        if isinstance(plan, SwitchPlan):
            rank = RankSwitchRecord(0, self.scheduler.active, plan.model, plan.gather.path,
                                    (0.0, SWITCH_S * 1000, 0.0, 0.0, 0.0), 0, 0, WEIGHTS[plan.model], False)
            self.scheduler.switched(plan, SwitchRecord((rank,)), self.reports(plan.ops.agree))
            return []
        for c in plan.chunks:
            self.ledger.record(c.seq_id, c.start_pos, c.token_ids)
        ops = plan.ops or MemoryOps()
        reports = self.reports(ops.agree) if ops.agree else None
        outputs = self.scheduler.commit(plan, {c.seq_id: token for c in plan.chunks if c.sample}, step_s, reports)
        for seq_id in ops.forget:
            self.ledger.forget(seq_id)
        return outputs

    def step(self, token: int = 50, step_s: float = 0.0) -> tuple[StepPlan | SwitchPlan | None, list[CallOutput]]:
        plan = self.scheduler.plan()
        return plan, ([] if plan is None else self.run(plan, token, step_s))

    def advance(self, token: int = 50, slowdown: float = 1.0) -> tuple[StepPlan | SwitchPlan | None, list[CallOutput]]:
        """One plan, run in the time the profile predicts for it times `slowdown` (the clock moves by that)."""
        plan = self.scheduler.plan()
        if plan is None:
            return None, []
        flight = self.scheduler.rounds.in_flight if self.scheduler.rounds is not None else None
        if flight is not None:
            self.clock.now += flight[1] * slowdown
        return plan, self.run(plan, token)

    def until_idle(self, limit: int = 500, arrivals: dict[float, list[InstanceCall]] | None = None,
                   slowdown: float = 1.0) -> list[CallOutput]:
        """`advance` until nothing is left to run; `arrivals` adds calls once the clock reaches their time."""
        pending = sorted((arrivals or {}).items())
        outputs = []
        for _ in range(limit):
            while pending and pending[0][0] <= self.clock.now + 1e-12:
                for c in pending.pop(0)[1]:
                    outputs += self.scheduler.add(c)
            plan, out = self.advance(slowdown=slowdown)
            outputs += out
            if plan is None:
                if not pending:
                    return outputs
                self.clock.now = pending[0][0]
        raise AssertionError(f"still busy after {limit} plans")

    def log(self) -> list[Event]:
        """Events since the last call."""
        self.events_seen += self.scheduler.drain_events()
        out, self.events_seen = self.events_seen, []
        return out


def instance(*models: str, now: float = 0.0, max_batch_tokens: int = 32, rounds: RoundConfig = ROUNDS,
             extra_pages: int = 0, learn: bool = True, hkvr: bool = True, hot: bool = False,
             host_slabs: int = 16, prefill_base_s: float = 0.0, ablations: tuple[Ablation, ...] = ()) -> Instance:
    """An instance serving `models`, assembled as every instance is, the first model open at `now`.
    `learn`: the cost model folds measured step times in (off: predictions stay the profile's).
    `hkvr`: a host KV registry of `host_slabs` pages (off: KV dropped at a switch is recomputed).
    `hot`: a hot pool of one model (continuous batching, no rounds). `prefill_base_s`: every prefill
    step's fixed cost (0: the toy prefill is per token only). `ablations`: ablated besides staging."""
    arena = 3584 + extra_pages * PAGE_BYTES
    layout = BumpLayout(arena, 256)
    for m in models:
        layout.register(m, WEIGHTS[m], LAYOUT)
    config = InstanceConfig("inst0", Pool.HOT if hot else Pool.COLD, models, arena_bytes=arena, page_size=PS,
                            max_batch_tokens=max_batch_tokens, max_running=8,
                            host_kv_bytes=host_slabs * PAGE_BYTES if hkvr else 0,
                            ablations=(Ablation.STAGING, *ablations))
    round_config = RoundConfig(**{**{f: getattr(rounds, f) for f in RoundConfig.__slots__},
                                  "max_batch_tokens": max_batch_tokens})
    events, clock = CopyEventsStandIn(), FakeClock(now)
    served = [ServedModel(m, WEIGHTS[m], LAYOUT, 64, (2,)) for m in models]
    s = assemble(config, layout, served, toy_profile(models, prefill_base_s), events, clock, learn=learn, rounds=round_config)
    return Instance(s, s.memory, s.memory.host, events, clock, RankLedger(0, PS))


def call(request_id: str, model: str = "a", prompt: Seq[int] = PROMPT, max_tokens: int = 16) -> InstanceCall:
    return InstanceCall(request_id, model, tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0))


def chain(tokens: Seq[int]) -> list[int]:
    """Cumulative hashes of the full pages of `tokens`, as every rank and the registry compute them."""
    out: list[int] = []
    for i in range(len(tokens) // PS):
        out.append(page_hash(out[-1] if out else ROOT_HASH, tokens[i * PS:(i + 1) * PS], PS))
    return out


def kind(plan: StepPlan | SwitchPlan | None) -> str | None:
    """'a' for a step of model a, '-> b' for a switch to b."""
    if isinstance(plan, SwitchPlan):
        return f"-> {plan.model}"
    return None if plan is None else plan.model


