"""Deterministic parity: a live instance's recorded run, replayed by the simulator.

A live instance with `record_steps` on writes a `call` event when each call arrives and a `step`
event for each step and switch: when it was planned and what it took (docs/events.md). Replaying
them, the simulator's instance — the same Scheduler, RoundScheduler, MemoryPlanner, host KV
registry and Stager, wired as `SimInstance` wires them — receives each call at its recorded time,
plans each step when the live instance planned it, charges its measured seconds (which also feed
the cost model's EWMA, as live) and samples the tokens the live run generated. Everything the
policy objects read is then what they read live, so they must make the same decisions: which
returns SP admits or parks, when the instance switches and by which path, which sessions restore
from host. `decisions` extracts those from an event list, for either run.

A replay that diverges raises `ParityError` at the first step whose kind (switch or step) differs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from talaria.config.schema import InstanceConfig
from talaria.contracts.call import CallOutput, InstanceCall
from talaria.contracts.events import Event, EventKind
from talaria.contracts.profile import Profile
from talaria.contracts.step_plan import SeqChunk, SwitchPlan
from talaria.sim.instance import SimInstance
from talaria.sim.loop import EventLoop, VirtualClock


class ParityError(RuntimeError):
    """The replay could not follow the recorded run."""


@dataclass(frozen=True, slots=True)
class RecordedStep:
    planned_at: float
    done_at: float  # the event's time: when the live scheduler committed (or finished the switch)
    seconds: float  # what the step measured (fed to the cost model)
    switch: bool


def recorded_steps(events: Iterable[Event], instance: str) -> list[RecordedStep]:
    return [RecordedStep(e.data["planned_at"], e.t, e.data["seconds"], bool(e.data.get("switch")))
            for e in events if e.instance == instance and e.kind is EventKind.STEP]


def arrivals(events: Iterable[Event], instance: str) -> dict[str, float]:
    """Request id -> when the live instance received it."""
    return {e.data["request"]: e.t for e in events if e.instance == instance and e.kind is EventKind.CALL}


class ReplayInstance(SimInstance):
    """A SimInstance whose steps run on the recorded schedule and sample the recorded tokens."""

    def __init__(self, config: InstanceConfig, profile: Profile, loop: EventLoop, steps: Sequence[RecordedStep],
                 outputs: dict[str, Sequence[int]], runtime_bytes: int) -> None:
        self.events: list[Event] = []
        super().__init__(config, profile, loop, lambda inst, outs: None, self.events.extend,
                         runtime_bytes=runtime_bytes, learn=True)
        self.steps = steps
        self.outputs = outputs
        self.next_step = 0

    def _step(self) -> None:
        if not self.scheduler.has_work:
            self.busy = False
            return
        if self.next_step >= len(self.steps):
            raise ParityError(f"the simulator has work after the live run's {len(self.steps)} steps")
        step = self.steps[self.next_step]
        if self.clock() < step.planned_at:  # live planned it later (its loop drained messages first)
            self.loop.at(step.planned_at, self._step)
            return
        plan = self.scheduler.plan()
        self._drain()
        if plan is None:
            self.loop.after(1e-6, self._step)
            return
        if isinstance(plan, SwitchPlan) != step.switch:
            what = {True: "a switch", False: "a step"}
            raise ParityError(f"step {self.next_step} at t={step.planned_at:.6f}: the live run planned "
                              f"{what[step.switch]}, the simulator {what[isinstance(plan, SwitchPlan)]}")
        self.next_step += 1
        if isinstance(plan, SwitchPlan):
            record, _ = self._switch_record(plan)
            self.loop.at(step.done_at, lambda: self._switched(plan, record))
            return
        self.loop.at(step.done_at, lambda: self._commit(plan, step.seconds))

    def _token(self, chunk: SeqChunk) -> int:
        call = self.scheduler.call_of(chunk.seq_id)
        return self.outputs[call.request_id][chunk.context_len - len(call.prompt_token_ids)]


def replay(config: InstanceConfig, profile: Profile, events: Sequence[Event], calls: Sequence[InstanceCall],
           outputs: dict[str, Sequence[int]], runtime_bytes: int) -> list[Event]:
    """Replay one instance's recorded run: `calls` as the live instance received them (their
    request ids name them in the `call` events), `outputs` the tokens it generated for each.
    Returns the simulator's events."""
    clock = VirtualClock()
    steps = recorded_steps(events, config.name)
    arrived = arrivals(events, config.name)
    missing = [c.request_id for c in calls if c.request_id not in arrived]
    if missing or not steps:
        raise ParityError(f"the events hold no record of {missing or 'any step'}: was record_steps on?")
    clock.now = min([*arrived.values(), steps[0].planned_at])
    loop = EventLoop(clock)
    inst = ReplayInstance(config, profile, loop, steps, outputs, runtime_bytes)
    for call in sorted(calls, key=lambda c: arrived[c.request_id]):
        loop.at(arrived[call.request_id], lambda call=call: inst.add(call))
    loop.run()
    if inst.next_step != len(steps):
        raise ParityError(f"the simulator ran {inst.next_step} of the live run's {len(steps)} steps")
    return inst.events


def decisions(events: Iterable[Event], instance: str) -> dict[str, list[tuple]]:
    """The scheduling decisions an event list records, in order, without times."""
    out: dict[str, list[tuple]] = {"sp_admit": [], "sp_park": [], "switch": [], "kv_restore": [], "rounds": []}
    for e in events:
        if e.instance != instance:
            continue
        d = e.data
        if e.kind is EventKind.SP_ADMIT:
            out["sp_admit"].append((d["request"], d["round"], d["tokens"], d["cached_tokens"]))
        elif e.kind is EventKind.SP_PARK:
            out["sp_park"].append((d["request"], d["round"], d["reason"]))
        elif e.kind is EventKind.SWITCH:
            out["switch"].append((d["from_model"], d["to_model"], d["path"]))
        elif e.kind is EventKind.KV_RESTORE:
            out["kv_restore"].append((d["request"], d["tokens"]))
        elif e.kind is EventKind.ROUND:
            out["rounds"].append((d["round"], tuple(s["model"] for s in d["slots"])))
    return out


def outputs_of(outputs: Iterable[CallOutput]) -> dict[str, list[int]]:
    """Request id -> the tokens generated for it, from a live run's CallOutputs."""
    tokens: dict[str, list[int]] = {}
    for o in outputs:
        tokens.setdefault(o.request_id, []).extend(o.token_ids)
    return tokens
