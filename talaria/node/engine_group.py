"""The supervisor's handle on one instance: its engine group of `tp` worker processes.

It spawns the workers, forwards calls over rank 0's pipe and turns the replies into per-call
asyncio queues. The event loop owns the pipe and never blocks on it: a reader callback takes
what has arrived, and writes are queued and flushed by a writer callback, so a worker that stops
reading (a long step, SIGSTOP) stalls only its own calls, never the gateway.

A group fails as a whole, and restarts: a monitor thread waits on every worker's process
sentinel, and a watchdog marks the group stalled when it has calls in flight and rank 0 has sent
nothing for max(`stall_s`, STALL_STEPS x its longest predicted step). Either way every call in
flight fails at once with InstanceFailed (no hang), the workers are killed, and the group is
respawned after a backoff that doubles with each failure in a row (a group that served a call, or
stayed up for HEALTHY_AFTER_S, starts the count again), so a crash loop costs little and shows in
`/health`, the telemetry's restart counter and the dashboard.

Workers rendezvous through a FileStore in a private folder, and gloo and NCCL bind to loopback:
nothing of a group listens beyond this machine (`talaria.executor.rank_loop`).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import wait

from talaria.config.schema import InstanceConfig
from talaria.contracts.call import (
    CallOutput,
    CancelCall,
    FinishReason,
    InstanceCall,
    InstanceReady,
    InstanceStats,
    Shutdown,
    SwitchDone,
    SwitchModel,
)
from talaria.contracts.events import Event
from talaria.contracts.profile import Profile
from talaria.executor.probes import Probes
from talaria.memory.rank_ledger import TestOnlyFault
from talaria.models.source import ModelFiles
from talaria.node.errors import CallFailed, InstanceFailed, InstanceUnavailable
from talaria.node.pipe import Pipe
from talaria.node.worker import WorkerSpec, worker_main

log = logging.getLogger("talaria.node")

STOP_GRACE_S = 5.0
WATCH_EVERY_S = 0.5  # how often the watchdog looks at each group
STALL_STEPS = 8  # the watchdog's k: a group is stalled after k x its longest predicted step (or stall_s)
BACKOFF_S = (0.5, 60.0)  # the first restart's delay, and the most a crash loop waits between restarts
HEALTHY_AFTER_S = 60.0  # a generation that stayed up this long (or served a call) resets the backoff


class EngineGroup:
    def __init__(self, config: InstanceConfig, models: list[ModelFiles], threads: int,
                 fault: TestOnlyFault | None = None,
                 on_events: Callable[[list[Event]], None] | None = None, probes: Probes | None = None) -> None:
        """fault: tests only — corrupt one rank's HKVR agreement reports. on_events: the event log.
        probes: measure the profile with these at start (`talaria profile`), whatever the config says."""
        self.config = config
        self.name = config.name
        self.models = models
        self.threads = threads
        self.probes = probes
        self.healthy = False
        self.restarts = 0
        self.state = "starting"  # starting | ready | restarting | stopped: what /health shows
        self.last_failure: str | None = None  # why it last failed, while it recovers from it
        self.stats: InstanceStats | None = None
        self.ready: InstanceReady | None = None  # the last ready report (its profile among it)
        self.fault = fault
        self._on_events = on_events
        self._calls: dict[str, asyncio.Queue] = {}
        self._switches: dict[str, asyncio.Future] = {}
        self._switch_ids = 0
        self._procs: list[mp.Process] = []
        self._conn = None  # rank 0's pipe as multiprocessing made it: kept to close it
        self._pipe: Pipe | None = None  # and used through this
        self._store: str | None = None  # the private folder of this generation's rendezvous file
        self._generation = 0  # bumped per spawn, so callbacks and threads of a dead group stay quiet
        self._up_since: float | None = None  # when this generation reported ready
        self._served = False  # this generation finished a call
        self._failures = 0  # failures in a row, for the backoff
        self._heard = 0.0  # when rank 0 last sent anything
        self._stall_after = config.stall_s
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready_event = asyncio.Event()
        self._watchdog: asyncio.Task | None = None

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the workers and wait until rank 0 reports ready (or raise why it could not)."""
        self._loop = asyncio.get_running_loop()
        self._spawn()
        await self._ready_event.wait()
        if self.ready is None or self.ready.error:  # None: a worker died before rank 0 reported
            why = self.ready.error if self.ready else "a worker process exited during startup (see its log)"
            raise InstanceFailed(f"instance {self.name} could not start: {why}")
        self._watchdog = asyncio.create_task(self._watch_stalls(), name=f"{self.name}-watchdog")

    def _spawn(self) -> None:
        self._generation += 1
        self._up_since, self._served = None, False
        self._ready_event.clear()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._store = tempfile.mkdtemp(prefix=f"talaria-{self.name}-")  # 0700: ours alone
        store = os.path.join(self._store, "rendezvous")
        self._procs = [ctx.Process(target=worker_main, name=f"talaria-{self.name}-rank{r}", daemon=True,
                                   args=(WorkerSpec(self.config, tuple(self.models), r, store, self.threads,
                                                    self.fault, self.probes),
                                         child if r == 0 else None))
                       for r in range(self.config.tp)]
        for p in self._procs:
            p.start()
        child.close()  # only rank 0 holds it now: its death closes our end
        self._conn, self._pipe = parent, Pipe(parent.fileno())
        self._heard = time.monotonic()
        gen = self._generation
        self._loop.add_reader(self._pipe.fileno(), self._read, self._pipe, gen)
        threading.Thread(target=self._watch, args=(list(self._procs), gen), daemon=True,
                         name=f"{self.name}-monitor").start()

    async def stop(self) -> None:
        """Ask rank 0 to stop every rank, then make sure no worker outlives us."""
        self._stopping = True
        self.healthy, self.state = False, "stopped"
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._send(Shutdown())
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self._procs:
            await asyncio.to_thread(p.join, max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        self._close_pipe()
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(1.0)
        if self._store is not None:
            shutil.rmtree(self._store, ignore_errors=True)
            self._store = None

    def _close_pipe(self) -> None:
        if self._pipe is not None:
            self._loop.remove_reader(self._pipe.fileno())
            self._loop.remove_writer(self._pipe.fileno())
            self._pipe.close()
            self._pipe = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # ---- rank 0's pipe, the monitor thread and the watchdog -> event loop -------------------

    def _send(self, msg: object) -> None:
        """Queue `msg` for rank 0; never blocks. A dead rank 0 is the monitor's to report."""
        pipe = self._pipe
        if pipe is None:
            return
        try:
            if pipe.queue(msg):  # backed up: flush when writable (re-adding replaces the callback)
                self._loop.add_writer(pipe.fileno(), self._write, pipe)
        except OSError:
            pass

    def _write(self, pipe: Pipe) -> None:
        if pipe is not self._pipe:
            return
        try:
            left = pipe.flush()
        except OSError:
            left = False
        if not left:
            self._loop.remove_writer(pipe.fileno())

    def _read(self, pipe: Pipe, gen: int) -> None:
        """The pipe is readable: deliver every batch rank 0 has finished sending."""
        if pipe is not self._pipe:  # a callback queued before its pipe was closed
            return
        batches = pipe.read()
        if batches is None:  # rank 0 is gone; the monitor thread reports the death
            self._loop.remove_reader(pipe.fileno())
            return
        if batches:
            self._heard = time.monotonic()
        for batch in batches:
            self._deliver(pickle.loads(batch), gen)

    def _watch(self, procs: list[mp.Process], gen: int) -> None:
        dead = wait([p.sentinel for p in procs])
        if dead:
            codes = [p.exitcode for p in procs]
            self._loop.call_soon_threadsafe(self._fail, gen, f"lost a worker process (exit codes {codes})")

    async def _watch_stalls(self) -> None:
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            quiet = time.monotonic() - self._heard
            if self.healthy and (self._calls or self._switches) and quiet > self._stall_after:
                self._fail(self._generation, f"stalled: rank 0 sent nothing for {quiet:.1f}s with "
                                             f"{len(self._calls)} calls in flight (limit {self._stall_after:.1f}s)")

    def _deliver(self, msgs: list, gen: int) -> None:
        if gen != self._generation:
            return
        events = []
        for m in msgs:  # outputs first: nothing the event log does can hold a call back
            if isinstance(m, CallOutput):
                q = self._calls.get(m.request_id)
                if q is not None:
                    q.put_nowait(m)
                if m.finish is not None:
                    self._served = True
            elif isinstance(m, Event):
                events.append(m)
            elif isinstance(m, InstanceStats):
                self.stats = m
            elif isinstance(m, SwitchDone):
                fut = self._switches.pop(m.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_exception(InstanceFailed(m.error)) if m.error else fut.set_result(m.record)
            elif isinstance(m, InstanceReady):
                self._became_ready(m)
        if events and self._on_events is not None:
            self._on_events(events)

    def _became_ready(self, m: InstanceReady) -> None:
        if m.error is not None and self.ready is not None:  # it worked before: a failed restart
            self._fail(self._generation, f"could not restart: {m.error}")
            return
        self.ready = m
        self.healthy = m.error is None
        self._ready_event.set()
        if self.healthy:
            self.state, self._up_since = "ready", time.monotonic()
            self._stall_after = stall_limit(self.config, self.models, m.profile)
            log.info("instance %s ready (%s) in %.1fs", self.name, ", ".join(m.models), m.load_s)

    def _fail(self, gen: int, why: str) -> None:
        """This generation is lost: fail its calls, kill its workers and respawn after the backoff."""
        if gen != self._generation or self._stopping:
            return
        self._generation += 1  # whatever the dead generation still says goes unheard
        log.error("instance %s %s; failing %d calls and restarting", self.name, why, len(self._calls))
        self.healthy, self.last_failure = False, why
        error = InstanceFailed(f"instance {self.name} {why}; it is restarting, retry the request")
        for q in self._calls.values():
            q.put_nowait(error)
        self._calls.clear()
        for fut in self._switches.values():
            if not fut.done():
                fut.set_exception(error)
        self._switches.clear()
        self._kill()
        self.restarts += 1
        if self.ready is None:  # it never started: start() reports why
            self._ready_event.set()
            return
        lived = self._up_since is not None and time.monotonic() - self._up_since >= HEALTHY_AFTER_S
        self._failures = 1 if (self._served or lived) else self._failures + 1
        delay = min(BACKOFF_S[0] * 2 ** (self._failures - 1), BACKOFF_S[1])
        self.state = "restarting"
        log.warning("instance %s: restart %d in %.1fs (%d failures in a row)", self.name, self.restarts, delay,
                    self._failures)
        self._loop.call_later(delay, self._respawn, self._generation)

    def _respawn(self, gen: int) -> None:
        if gen == self._generation and not self._stopping:
            self.state = "starting"
            self._spawn()

    # ---- calls -----------------------------------------------------------------------------

    async def switch(self, model: str, timeout: float) -> dict | None:
        """Force a switch to `model`; its SwitchRecord as JSON (None if it was already active)."""
        if not self.healthy:
            raise InstanceUnavailable(f"instance {self.name} is not ready")
        self._switch_ids += 1
        request_id = f"switch-{self._switch_ids}"
        fut = self._loop.create_future()
        self._switches[request_id] = fut
        self._send(SwitchModel(model, request_id))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._switches.pop(request_id, None)

    async def generate(self, call: InstanceCall) -> AsyncIterator[CallOutput]:
        """Stream a call's outputs; closing the iterator early cancels the call on the instance."""
        if not self.healthy:
            raise InstanceUnavailable(f"instance {self.name} is not ready")
        if call.request_id in self._calls:
            raise ValueError(f"duplicate request id {call.request_id}")
        q: asyncio.Queue = asyncio.Queue()
        if not self._calls and not self._switches:
            self._heard = max(self._heard, time.monotonic())  # the watchdog's clock starts with the work
        self._calls[call.request_id] = q
        gen = self._generation
        finished = False
        try:
            self._send(call)
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                if item.finish is FinishReason.ERROR:
                    finished = True
                    raise CallFailed(item.error or f"instance {self.name} failed the call")
                finished = item.finish is not None
                yield item
                if finished:
                    return
        finally:
            self._calls.pop(call.request_id, None)
            if not finished and gen == self._generation and self.healthy:
                self._send(CancelCall(call.request_id))


def stall_limit(config: InstanceConfig, models: list[ModelFiles], profile: Profile | None) -> float:
    """How long a group with work may send nothing before the watchdog calls it stalled:
    max(stall_s, STALL_STEPS x the longest step its profile predicts: a full prefill chunk at the
    end of the context, a full decode batch over whole contexts, or opening a model)."""
    longest = 0.0
    for m in models:
        if profile is None or m.name not in profile.models:
            continue
        context = m.arch.max_position
        longest = max(longest, profile.prefill_s(m.name, config.max_batch_tokens, context),
                      profile.decode_s(m.name, config.max_running, config.max_running * context),
                      profile.switch_s(m.name))
    return max(config.stall_s, STALL_STEPS * longest)
