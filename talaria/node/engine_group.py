"""The supervisor's handle on one instance: its engine group of `tp` worker processes.

It spawns the workers, forwards calls over rank 0's pipe and turns the replies into per-call
asyncio queues; the event loop reads the pipe itself (a reader callback that never blocks, no
thread hop between a token and the request waiting for it). A monitor thread waits on every
worker's process sentinel: when any worker dies, every call in flight fails at once with
InstanceFailed (no hang), the survivors are killed, and the group restarts; later calls succeed
once the new group reports ready.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import pickle
import socket
import struct
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
from talaria.executor.probes import Probes
from talaria.memory.rank_ledger import TestOnlyFault
from talaria.models.source import ModelFiles
from talaria.node.errors import InstanceFailed, InstanceUnavailable
from talaria.node.worker import WorkerSpec, worker_main

log = logging.getLogger("talaria.node")

STOP_GRACE_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Frames:
    """Rank 0's messages, read off our end of the pipe without ever blocking the event loop: each
    read takes what has arrived, and whole messages are cut from it by multiprocessing.Connection's
    framing (a 4-byte big-endian length; above 2 GiB, -1 there and then an 8-byte one). A worker
    that stops halfway through a message stalls only its own calls, never the gateway."""

    def __init__(self, fd: int) -> None:
        self._sock = socket.socket(fileno=os.dup(fd))
        self._buf = bytearray()

    def fileno(self) -> int:
        return self._sock.fileno()

    def read(self) -> list[bytes] | None:
        """The messages completed by what has arrived; None once rank 0's end is closed."""
        try:
            chunk = self._sock.recv(1 << 20, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return []
        except OSError:
            return None
        if not chunk:
            return None
        buf = self._buf
        buf += chunk
        frames = []
        while len(buf) >= 4:
            (size,) = struct.unpack_from("!i", buf)
            start = 4
            if size == -1:
                if len(buf) < 12:
                    break
                (size,) = struct.unpack_from("!Q", buf, 4)
                start = 12
            if len(buf) < start + size:
                break
            frames.append(bytes(buf[start:start + size]))
            del buf[:start + size]
        return frames

    def close(self) -> None:
        self._sock.close()


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
        self.stats: InstanceStats | None = None
        self.ready: InstanceReady | None = None
        self.fault = fault
        self._on_events = on_events
        self._calls: dict[str, asyncio.Queue] = {}
        self._switches: dict[str, asyncio.Future] = {}
        self._switch_ids = 0
        self._procs: list[mp.Process] = []
        self._conn = None  # our end of rank 0's pipe: we send on it
        self._frames: _Frames | None = None  # and read it through this
        self._generation = 0  # bumped per spawn, so callbacks and threads of a dead group stay quiet
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready_event = asyncio.Event()

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

    def _spawn(self) -> None:
        self._generation += 1
        self._ready_event.clear()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        port = _free_port()
        self._procs = [ctx.Process(target=worker_main, name=f"talaria-{self.name}-rank{r}", daemon=True,
                                   args=(WorkerSpec(self.config, tuple(self.models), r, port, self.threads,
                                                    self.fault, self.probes),
                                         child if r == 0 else None))
                       for r in range(self.config.tp)]
        for p in self._procs:
            p.start()
        child.close()  # only rank 0 holds it now: its death closes our end
        self._conn, self._frames = parent, _Frames(parent.fileno())
        gen = self._generation
        self._loop.add_reader(self._frames.fileno(), self._read, self._frames, gen)
        threading.Thread(target=self._watch, args=(list(self._procs), gen), daemon=True,
                         name=f"{self.name}-monitor").start()

    async def stop(self) -> None:
        """Ask rank 0 to stop every rank, then make sure no worker outlives us."""
        self._stopping = True
        self.healthy = False
        try:
            self._conn.send(Shutdown())
        except (OSError, AttributeError):
            pass
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

    def _close_pipe(self) -> None:
        if self._frames is not None:
            self._loop.remove_reader(self._frames.fileno())
            self._frames.close()
            self._frames = None
        if self._conn is not None:
            self._conn.close()

    # ---- rank 0's pipe and the monitor thread -> event loop ---------------------------------

    def _read(self, frames: _Frames, gen: int) -> None:
        """The pipe is readable: deliver every batch rank 0 has finished sending."""
        if frames is not self._frames:  # a callback queued before its pipe was closed
            return
        batches = frames.read()
        if batches is None:  # rank 0 is gone; the monitor thread reports the death
            self._loop.remove_reader(frames.fileno())
            return
        for batch in batches:
            self._deliver(pickle.loads(batch), gen)

    def _watch(self, procs: list[mp.Process], gen: int) -> None:
        dead = wait([p.sentinel for p in procs])
        if dead:
            self._loop.call_soon_threadsafe(self._died, gen)

    def _deliver(self, msgs: list, gen: int) -> None:
        if gen != self._generation:
            return
        events = [m for m in msgs if isinstance(m, Event)]
        if events and self._on_events is not None:
            self._on_events(events)
        for m in msgs:
            if isinstance(m, CallOutput):
                q = self._calls.get(m.request_id)
                if q is not None:
                    q.put_nowait(m)
            elif isinstance(m, InstanceStats):
                self.stats = m
            elif isinstance(m, SwitchDone):
                fut = self._switches.pop(m.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_exception(InstanceFailed(m.error)) if m.error else fut.set_result(m.record)
            elif isinstance(m, InstanceReady):
                self.ready = m
                self.healthy = m.error is None
                self._ready_event.set()
                if self.healthy:
                    log.info("instance %s ready (%s) in %.1fs", self.name, ", ".join(m.models), m.load_s)

    def _died(self, gen: int) -> None:
        if gen != self._generation or self._stopping:
            return
        codes = [p.exitcode for p in self._procs]
        log.error("instance %s: a worker died (exit codes %s); failing %d calls and restarting",
                  self.name, codes, len(self._calls))
        self.healthy = False
        error = InstanceFailed(f"instance {self.name} lost a worker process (exit codes {codes}); "
                               "it is restarting, retry the request")
        for q in self._calls.values():
            q.put_nowait(error)
        self._calls.clear()
        for fut in self._switches.values():
            if not fut.done():
                fut.set_exception(error)
        self._switches.clear()
        self._kill()
        self.restarts += 1
        if self.ready is not None and self.ready.error is None:  # it worked before: try again
            self._spawn()
        else:
            self._ready_event.set()

    # ---- calls -----------------------------------------------------------------------------

    async def switch(self, model: str, timeout: float) -> dict | None:
        """Force a switch to `model`; its SwitchRecord as JSON (None if it was already active)."""
        if not self.healthy:
            raise InstanceUnavailable(f"instance {self.name} is not ready")
        self._switch_ids += 1
        request_id = f"switch-{self._switch_ids}"
        fut = self._loop.create_future()
        self._switches[request_id] = fut
        self._conn.send(SwitchModel(model, request_id))
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
        self._calls[call.request_id] = q
        gen = self._generation
        finished = False
        try:
            self._conn.send(call)
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                if item.finish is FinishReason.ERROR:
                    finished = True
                    raise InstanceFailed(item.error or f"instance {self.name} failed the call")
                finished = item.finish is not None
                yield item
                if finished:
                    return
        finally:
            self._calls.pop(call.request_id, None)
            if not finished and gen == self._generation and self.healthy:
                try:
                    self._conn.send(CancelCall(call.request_id))
                except OSError:
                    pass
