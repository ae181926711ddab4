"""The instance scheduler on rank 0: calls in, one plan per step, CallOutputs back.

It owns a Batcher per model the instance serves, and one model is active in the arena at a time.
A hot instance batches its one model continuously. A cold instance asks its RoundScheduler what
comes next: a switch at a slot boundary, or a step of one slot phase (P, D, SP). A forced switch
(the admin API) goes first and closes the round. The scheduler adds the memory ops to each step,
turns finished steps into CallOutputs, and keeps the telemetry snapshot. Time comes from an
injected clock so tests and the simulator drive it deterministically.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from itertools import count

from talaria.config.schema import Pool
from talaria.contracts.call import (
    CallOutput,
    CallTimings,
    FinishReason,
    InstanceCall,
    Usage,
)
from talaria.contracts.events import Event, EventKind
from talaria.contracts.step_plan import StepPlan, SwitchPlan
from talaria.contracts.telemetry import InstanceStats, ModelQueue, RoundState
from talaria.contracts.vocabulary import KVLocation
from talaria.instance.batcher import Batcher
from talaria.instance.cost_model import CostModel
from talaria.instance.memory_planner import MemoryPlanner
from talaria.instance.round_scheduler import RoundScheduler
from talaria.instance.rounds import Switch
from talaria.instance.sequence import SeqStatus, Sequence
from talaria.memory.host_kv_registry import RankReport
from talaria.memory.page_manager import chain_root

MAX_SESSIONS_SHOWN = 256  # recent sessions whose KV location telemetry reports
MAX_SESSIONS_KNOWN = 100_000  # sessions remembered as served here (SP admits only their continuations)


class Scheduler:
    def __init__(self, instance: str, batchers: dict[str, Batcher], clock: Callable[[], float],
                 memory: MemoryPlanner, costs: CostModel, rounds: Callable[..., RoundScheduler] | None = None,
                 version_base: int = 0, record_steps: bool = False) -> None:
        """`costs`: the instance's predicted costs; a hot instance corrects them from its step times
        here, a cold one in its round scheduler. `rounds` builds the cold pool's RoundScheduler from
        (batchers, clock, emit, switch_coverage, known_session); None makes a hot instance (one model,
        continuous batching). Snapshot versions
        count up from `version_base`: a restarted instance passes a larger one (its start time), so
        its snapshots still look newer than its predecessor's. `record_steps`: emit a `call` event per
        call and a `step` event per step and switch, with when it was planned and what it took: what
        the simulator needs to replay this instance's decisions (talaria.sim.parity)."""
        self.instance = instance
        self.batchers = batchers
        self.clock = clock
        self.memory = memory
        self.costs = costs
        self._known: OrderedDict[str, None] = OrderedDict()  # sessions served here, most recent last
        self.rounds = None if rounds is None else rounds(batchers, clock, self._emit, self._switch_coverage,
                                                         self._known.__contains__)
        self._seqs: dict[int, Sequence] = {}
        self._by_request: dict[str, Sequence] = {}
        self._ids = count()
        self._order = list(batchers)
        self.active: str | None = None
        self._forced: str | None = None
        self.switches: list = []  # SwitchRecords, oldest first
        self._sessions: OrderedDict[str, tuple[str, tuple[int, ...]]] = OrderedDict()  # id -> (model, hashes)
        self._events: list[Event] = []  # since the last drain_events()
        self._stats_version = version_base
        self._sizes: dict[str, dict[str, int]] | None = None  # per model cache sizes for snapshots
        self.switch_count = 0
        self.record_steps = record_steps
        self._planned_at = 0.0  # when the plan in flight was made (record_steps)

    @property
    def has_work(self) -> bool:
        pending_saves = any(b.saves for b in self.batchers.values())
        return any(b.has_work for b in self.batchers.values()) or pending_saves or self.memory.busy

    def add(self, call: InstanceCall) -> list[CallOutput]:
        """Queue a call; a call that can never run is answered at once."""
        batcher = self.batchers.get(call.model)
        if batcher is None:
            return [self._error(call.request_id, f"instance {self.instance} does not serve {call.model!r}")]
        seq = Sequence(next(self._ids), call, list(call.prompt_token_ids), self.clock(), root=chain_root(call.cache_salt))
        batcher.add(seq)
        if seq.status is SeqStatus.FINISHED:
            pages = batcher.pages
            return [self._error(call.request_id, f"prompt of {len(seq.token_ids)} tokens needs "
                                f"{pages.pages_for(len(seq.token_ids) + 1)} KV pages; the pool has "
                                f"{pages.num_pages} (raise arena_bytes)")]
        self._seqs[seq.seq_id] = seq
        self._by_request[call.request_id] = seq
        if self.record_steps:
            self._emit(EventKind.CALL, request=call.request_id, session=call.session_id, model=call.model,
                       prompt_tokens=len(call.prompt_token_ids), max_tokens=call.sampling.max_tokens)
        return []

    def cancel(self, request_id: str) -> list[CallOutput]:
        seq = self._by_request.get(request_id)
        if seq is None:
            return []
        self.batchers[seq.model].remove(seq)
        seq.finish = FinishReason.CANCELLED
        self._settle()
        return [self._output(seq)]

    def fail(self, request_id: str, why: str) -> list[CallOutput]:
        """End one call with an error it caused (it cannot go on); every other call goes on as it was."""
        seq = self._by_request.get(request_id)
        if seq is None:
            return []
        self.batchers[seq.model].remove(seq)
        seq.finish = FinishReason.ERROR
        self._settle()
        return [replace(self._output(seq), error=why)]

    def call_of(self, seq_id: int) -> InstanceCall:
        return self._seqs[seq_id].call

    def force_switch(self, model: str) -> None:
        """Open `model` at the next plan, whatever the queues say (admin API, tests)."""
        if model not in self.batchers:
            raise KeyError(model)
        self._forced = model

    def stage_next(self, model: str) -> None:
        """Stage `model` next instead of the next model in slot order (until the next switch)."""
        if model not in self.batchers:
            raise KeyError(model)
        self.memory.retarget(self.active, model)

    def plan(self) -> StepPlan | SwitchPlan | None:
        """The next thing to run: a switch, or a step of the active model (maybe only memory ops)."""
        if self.record_steps:
            self._planned_at = self.clock()
        forced, self._forced = self._forced, None
        if forced is not None and forced != self.active:
            if self.rounds is not None:
                self.rounds.close()
            return self._switch(forced)
        if self.rounds is None:
            step = self.batchers[self.active].plan(self.clock())
            chunks = step.chunks if step is not None else ()
        else:
            decision = self.rounds.next(self.active)
            if isinstance(decision, Switch):
                return self._switch(decision.model)
            chunks = decision.chunks if decision is not None else ()
        batcher = self.batchers[self.active]
        ops = self.memory.ops(batcher, idle=not chunks)
        for seq, restored in batcher.restored:
            self._emit(EventKind.KV_RESTORE, model=self.active, session=seq.call.session_id,
                       request=seq.call.request_id, tokens=restored)
        batcher.restored.clear()
        if not chunks and not ops:
            return None
        return StepPlan(self.active, chunks, ops)

    def _switch(self, model: str) -> SwitchPlan:
        outgoing = self.batchers[self.active] if self.active is not None else None
        if outgoing is not None:
            outgoing.suspend()
        return self.memory.switch_plan(model, outgoing)

    def _switch_coverage(self, model: str) -> float:
        """How much of `model`'s weights a switch to it would find staged (0: it loads them all from host)."""
        return self.memory.switch_coverage(model)

    def _rotation(self) -> list[str]:
        """The other models, in round-robin order after the active one."""
        i = self._order.index(self.active) if self.active in self._order else -1
        return [self._order[(i + k) % len(self._order)] for k in range(1, len(self._order))]

    def _next_model(self) -> str | None:
        """The model expected after the active one: the round's next slot, else the rotation's next."""
        r = self.rounds.round if self.rounds is not None else None
        if r is not None:
            upcoming = [m for m in r.queue if m != self.active]
            if upcoming:
                return upcoming[0]
        rotation = self._rotation()
        return rotation[0] if rotation else None

    def switched(self, plan: SwitchPlan, record, reports: list[list[RankReport]]) -> None:
        """The group opened plan.model: settle the agreed saves, hand the batcher its fresh pool."""
        if plan.ops.agree:
            self._checkpointed(self.memory.agreed(plan.ops.agree, reports))
        self.active = plan.model
        self.batchers[plan.model].resume(self.memory.new_pool(plan.model))
        self.memory.switched(plan.model, self._next_model())
        if self.rounds is not None:
            self.rounds.committed()
            self._settle()  # its calls may have been cancelled during the switch
        if record is not None:
            self.switches.append(record)
            self.switch_count += 1
            del self.switches[:-16]
            self._emit(EventKind.SWITCH, **record.to_dict())
            if self.record_steps:
                self._emit(EventKind.STEP, model=plan.model, planned_at=self._planned_at,
                           seconds=self.clock() - self._planned_at, tokens=0, seqs=0, switch=True)

    def commit(self, plan: StepPlan, sampled: dict[int, int], step_s: float,
               reports: list[list[RankReport]] | None = None) -> list[CallOutput]:
        now = self.clock()
        if self.record_steps:
            prefill_s, restore_s, decode_s = self.costs.profile.step_parts(plan, self.costs.page_size)
            self._emit(EventKind.STEP, model=plan.model, planned_at=self._planned_at, seconds=step_s,
                       tokens=plan.num_tokens, seqs=len(plan.chunks), priced_prefill_s=prefill_s,
                       priced_restore_s=restore_s, priced_decode_s=decode_s)
        if self.rounds is not None:
            self.rounds.committed(step_s)
        elif plan.chunks:
            self.costs.observe_step(plan, step_s)
        batcher = self.batchers[plan.model]
        batcher.step_done()
        if plan.ops is not None and plan.ops.agree:
            self._checkpointed(self.memory.agreed(plan.ops.agree, reports))
        for chunk in plan.chunks:
            seq = self._seqs.get(chunk.seq_id)
            if seq is not None and seq.first_token_at is None:
                seq.prefill_s += step_s
        outputs = []
        for seq in batcher.commit(plan, sampled, self._seqs):
            if seq.first_token_at is None:
                seq.first_token_at = now
            seq.last_token_at = now
            outputs.append(self._output(seq))
        self._settle()
        return outputs

    def _settle(self) -> None:
        """Nothing is left to run: the open round ends with its work (RoundScheduler.close). The rank
        loop stops stepping here, so an open slot would last through the idle gap and its round report
        the gap as an overrun: deadline risk that was never there. A step or switch in flight settles
        at its commit."""
        rounds = self.rounds
        if rounds is not None and rounds.in_flight is None and not any(b.has_work for b in self.batchers.values()):
            rounds.close()

    def _output(self, seq: Sequence) -> CallOutput:
        new = tuple(seq.token_ids[seq.num_prompt + seq.num_emitted:])
        seq.num_emitted += len(new)
        if seq.finish is None:
            return CallOutput(seq.call.request_id, new, committed_kv_tokens=seq.num_computed)
        self.memory.finished(seq.seq_id)
        if seq.call.session_id is not None:
            self._known[seq.call.session_id] = None
            self._known.move_to_end(seq.call.session_id)
            if len(self._known) > MAX_SESSIONS_KNOWN:
                self._known.popitem(last=False)
            self._sessions[seq.call.session_id] = (seq.model, seq.page_hashes)
            self._sessions.move_to_end(seq.call.session_id)
            while len(self._sessions) > MAX_SESSIONS_SHOWN:
                self._sessions.popitem(last=False)
        self._seqs.pop(seq.seq_id, None)
        self._by_request.pop(seq.call.request_id, None)
        first = self.clock() if seq.first_token_at is None else seq.first_token_at
        scheduled = seq.arrival if seq.first_scheduled is None else seq.first_scheduled
        last = first if seq.last_token_at is None else seq.last_token_at
        timings = CallTimings(queued_s=scheduled - seq.arrival, prefill_s=seq.prefill_s,
                              decode_s=last - first, first_token_at=first, service_s=self.clock() - seq.arrival)
        usage = Usage(seq.num_prompt, seq.num_generated, seq.num_cached, seq.num_restored)
        return CallOutput(seq.call.request_id, new, seq.finish, usage, seq.num_computed, timings)

    def _error(self, request_id: str, message: str) -> CallOutput:
        return CallOutput(request_id, (), FinishReason.ERROR, error=message)

    def _emit(self, kind: EventKind, **data) -> None:
        self._events.append(Event(self.clock(), self.instance, kind, data))

    def _checkpointed(self, saves: list[dict]) -> None:
        for save in saves:
            self._emit(EventKind.KV_CHECKPOINT, **save)

    def drain_events(self) -> list[Event]:
        """Events since the last call, oldest first (the worker ships them with its outputs)."""
        events, self._events = self._events, []
        return events

    def session_states(self, exact: bool = True) -> tuple[dict, ...]:
        """Where each recent session's KV is now: device-resident, host-restorable or missing.

        `exact` walks every page of every prefix; otherwise (the simulator's heartbeats) only the
        last page is looked up, which says where a whole prefix is unless part of it was evicted."""
        out = []
        host, ps = self.memory.host, self.memory.page_size
        if host is not None and not host.sessions:
            host = None  # HKVR ablated: what the host holds is in-flight swaps, never a session's return
        for session, (model, chain) in self._sessions.items():
            pool = self.batchers[model].pages
            probe = chain if exact else chain[-1:]
            # what it could resume from (a stateful cache: up to a state snapshot, the last page's for a probe)
            on_device = len(pool.resume_prefix(probe)) if model == self.active else 0
            on_host = host.resumable(model, probe) if host is not None else 0
            if not exact:
                on_device, on_host = on_device * len(chain), on_host * len(chain)
            where = (KVLocation.DEVICE if chain and on_device == len(chain) else
                     KVLocation.HOST if chain and on_host == len(chain) else KVLocation.MISSING)
            out.append({"session": session, "model": model, "kv_tokens": len(chain) * ps, "location": where,
                        "device_tokens": on_device * ps, "host_tokens": on_host * ps})
        return tuple(out)

    def stats(self, exact: bool = True) -> InstanceStats:
        bs = self.batchers.values()
        pool = self.batchers[self.active].pages if self.active is not None else None
        last = self.switches[-1].to_dict() if self.switches else None
        self._stats_version += 1
        return InstanceStats(
            instance=self.instance,
            version=self._stats_version,
            waiting=sum(len(b.waiting) for b in bs),
            running=sum(len(b.running) for b in bs),
            kv_pages_used=pool.num_used if pool else 0,
            kv_pages_total=pool.num_pages if pool else 0,
            preemptions=sum(b.preemptions for b in bs),
            lost_tokens=sum(b.lost_tokens for b in bs),
            prefix_hit_tokens=sum(b.prefix_hit_tokens for b in bs),
            models=tuple(self.batchers),
            active_model=self.active,
            host_restored_tokens=sum(b.restored_tokens for b in bs),
            switches=self.switch_count,
            last_switch=last,
            substrate=self.memory.telemetry(self.clock(), slack=exact),
            sessions=self.session_states(exact),
            pool=Pool.HOT if self.rounds is None else Pool.COLD,
            staged_model=self.memory.stager.target_model if self.memory.stager is not None else None,
            queues=tuple(ModelQueue(m, len(b.waiting), len(b.running), m == self.active)
                         for m, b in self.batchers.items()),
            rounds=self._round_state(),
            last_switches=tuple(r.to_dict() for r in self.switches[-4:]),
            time=self.clock(),
            page_size=self.memory.page_size,
            cost_scale=self.costs.telemetry(),
            **self._cache_sizes(),
        )

    def _cache_sizes(self) -> dict[str, dict[str, int]]:
        """Each served model's page bytes, state-slot bytes and state slots, from its arena layout
        (fixed once the models are registered: worked out at the first snapshot)."""
        if self._sizes is None:
            plans = [self.memory.layout.plan(m) for m in self.batchers]
            self._sizes = {"page_bytes": {p.model: p.page_bytes for p in plans},
                           "state_bytes": {p.model: p.state_bytes for p in plans},
                           "state_slots": {p.model: p.num_state_slots for p in plans}}
        return {k: dict(v) for k, v in self._sizes.items()}  # each snapshot its own dicts

    def _round_state(self) -> RoundState | None:
        if self.rounds is None:
            return None
        t = self.rounds.telemetry()
        return RoundState(t["round"], t["round_remaining_s"], t["slot"], t["deadline_risk"], t["sp_admitted"],
                          t["sp_parked"], tuple(t["rounds"]), self.rounds.config.round_s)
