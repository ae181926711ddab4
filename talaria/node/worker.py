"""The entry point of one engine-group worker process (spawned by talaria.node.engine_group).

Every rank joins the group's torch.distributed process group (gloo on CPU, NCCL on CUDA) and
builds an EngineCore. Rank 0 talks to the supervisor over a pipe: it drains calls and cancels
between steps, steps while there is work, and sends outputs and periodic stats back. Other ranks
follow rank 0's plans until it broadcasts a stop.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

from talaria.config.schema import Device, InstanceConfig
from talaria.contracts.call import (
    CallOutput,
    CancelCall,
    FinishReason,
    InstanceCall,
    InstanceReady,
    Shutdown,
    SwitchDone,
    SwitchModel,
)
from talaria.executor.calibrate import Probes
from talaria.memory.rank_ledger import TestOnlyFault
from talaria.models.source import ModelFiles

STATS_EVERY_S = 0.25
IDLE_POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    instance: InstanceConfig
    models: tuple[ModelFiles, ...]
    rank: int
    master_port: int
    threads: int
    fault: TestOnlyFault | None = None  # tests only: corrupt one rank's HKVR agreement reports
    probes: Probes | None = None  # `talaria profile`: calibrate with these, whatever the config says


def worker_main(spec: WorkerSpec, conn: Connection | None) -> None:
    import torch
    import torch.distributed as dist

    from talaria.executor.executor import EngineCore
    from talaria.executor.parallel import TPGroup

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when we stop
    _die_with_parent()
    torch.set_num_threads(spec.threads)
    tp = spec.instance.tp
    if tp > 1:
        backend = "nccl" if spec.instance.device is Device.CUDA else "gloo"
        if spec.instance.device is Device.CUDA:
            torch.cuda.set_device(spec.rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{spec.master_port}",
                                rank=spec.rank, world_size=tp, timeout=timedelta(days=7))
    t0 = time.monotonic()
    try:
        core = EngineCore(spec.instance, list(spec.models), TPGroup(spec.rank, tp), fault=spec.fault,
                          probes=spec.probes)
    except Exception as e:
        if conn is not None:
            conn.send([InstanceReady(spec.instance.name, (), 0, 0.0, error=f"{type(e).__name__}: {e}")])
        raise
    if spec.rank != 0:
        while core.follow():
            pass
        return
    conn.send([InstanceReady(spec.instance.name, tuple(m.name for m in spec.models), core.pages,
                             time.monotonic() - t0, profile=core.profile),
               core.stats()])  # the router places nothing on an instance it has no snapshot of
    _serve(core, conn)


def _force_switch(core, msg: SwitchModel, waiting: list) -> list:
    sched = core.scheduler
    if msg.model not in sched.batchers:
        return [SwitchDone(msg.request_id, None, f"instance {core.instance.name} does not serve {msg.model!r}")]
    if sched.active == msg.model:
        return [SwitchDone(msg.request_id, None)]
    sched.force_switch(msg.model)
    waiting.append((msg, len(sched.switches)))
    return []


def _switched(core, waiting: list) -> list:
    """Answer admin switches whose switch has happened."""
    sched, done = core.scheduler, []
    for item in list(waiting):
        msg, mark = item
        if len(sched.switches) > mark and sched.active == msg.model:
            done.append(SwitchDone(msg.request_id, sched.switches[-1].to_dict()))
            waiting.remove(item)
    return done


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the supervisor dies, even by SIGKILL, so no worker is orphaned."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _serve(core, conn: Connection) -> None:
    """Rank 0's loop: messages in, steps, outputs out."""
    last_stats = 0.0
    in_flight: set[str] = set()
    switches: list[tuple[SwitchModel, int]] = []  # admin switches waiting for their record
    try:
        while True:
            out: list = []
            timeout = 0 if core.has_work else IDLE_POLL_S
            while conn.poll(timeout):
                msg = conn.recv()
                timeout = 0
                if isinstance(msg, InstanceCall):
                    in_flight.add(msg.request_id)
                    out += core.add(msg)
                elif isinstance(msg, CancelCall):
                    out += core.cancel(msg.request_id)
                elif isinstance(msg, SwitchModel):
                    out += _force_switch(core, msg, switches)
                elif isinstance(msg, Shutdown):
                    core.stop()
                    return
            if core.has_work or switches:
                out += core.step()
            out += _switched(core, switches)
            out += core.scheduler.drain_events()
            now = time.monotonic()
            if now - last_stats >= STATS_EVERY_S:
                out.append(core.stats())
                last_stats = now
            if out:
                for o in out:
                    if isinstance(o, CallOutput) and o.finish is not None:
                        in_flight.discard(o.request_id)
                conn.send(out)
    except (EOFError, BrokenPipeError):
        os._exit(0)  # the supervisor is gone: nobody to serve
    except Exception as e:  # noqa: BLE001 -- whatever broke, fail the calls and let the group restart
        message = f"engine error: {type(e).__name__}: {e}"
        traceback.print_exc()
        try:
            conn.send([CallOutput(r, (), FinishReason.ERROR, error=message) for r in in_flight])
        finally:
            os._exit(1)  # the group's state is unknown: let the supervisor restart it
