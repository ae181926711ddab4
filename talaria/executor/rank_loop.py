"""One worker process of an engine group, once spawned: join the group, build the rank, serve.

Every rank joins the group's torch.distributed process group (gloo on CPU, NCCL on CUDA) and builds
its `Executor`. Rank 0 starts the `Driver` and talks to the supervisor over a pipe: it drains calls
and cancels between steps, steps while there is work, and sends outputs and periodic stats back.
Other ranks follow rank 0's plans until it broadcasts a stop.

Nothing listens beyond loopback: the ranks meet through a FileStore (no TCP store, no port to race
for) and gloo and NCCL open their sockets on `lo`. Collectives time out after COLLECTIVE_TIMEOUT_S,
so a rank stuck in one exits rather than waiting for ever; an idle rank 0 broadcasts a keep-alive
every KEEPALIVE_S so that waiting for the next plan is never mistaken for a stall.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from talaria.config.schema import Device, InstanceConfig
from talaria.contracts.call import (
    CancelCall,
    InstanceCall,
    InstanceReady,
    Shutdown,
    SwitchDone,
    SwitchModel,
)
from talaria.executor.driver import Driver, start_driver
from talaria.executor.executor import Executor
from talaria.executor.parallel import TPGroup
from talaria.executor.probes import Probes
from talaria.memory.rank_ledger import TestOnlyFault
from talaria.models.source import ModelFiles

STATS_EVERY_S = 0.25
IDLE_POLL_S = 0.5
KEEPALIVE_S = 10.0  # an idle rank 0 broadcasts a no-op plan this often (tp > 1)
COLLECTIVE_TIMEOUT_S = 300.0  # a collective not completed by then raises: the rank exits, the group restarts
LOOPBACK = "lo"


def run_rank(instance: InstanceConfig, models: list[ModelFiles], rank: int, rendezvous: str, threads: int,
             conn: Connection | None, fault: TestOnlyFault | None = None, probes: Probes | None = None) -> None:
    """The whole life of one rank; `conn` is rank 0's pipe to the supervisor (None on other ranks);
    `rendezvous`: the path of the group's FileStore."""
    torch.set_num_threads(threads)
    tp = instance.tp
    if instance.device is Device.CUDA:  # before any CUDA call: this rank's GPU from the instance's devices
        torch.cuda.set_device(torch.device(instance.rank_device(rank)))
    if tp > 1:
        backend = "nccl" if instance.device is Device.CUDA else "gloo"
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = LOOPBACK
        dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=tp,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    t0 = time.monotonic()
    try:
        executor = Executor(instance, models, TPGroup(rank, tp), fault=fault)
        driver = start_driver(executor, probes=probes) if rank == 0 else None
    except Exception as e:
        if conn is not None:
            conn.send([InstanceReady(instance.name, (), 0, 0.0, error=f"{type(e).__name__}: {e}")])
        raise
    if driver is None:
        while executor.follow():
            pass
        return
    conn.send([InstanceReady(instance.name, tuple(m.name for m in models), executor.pages,
                             time.monotonic() - t0, profile=driver.profile),
               driver.stats()])  # the router places nothing on an instance it has no snapshot of
    _serve(driver, conn)


def _force_switch(driver: Driver, msg: SwitchModel, waiting: list) -> list:
    sched = driver.scheduler
    if msg.model not in sched.batchers:
        return [SwitchDone(msg.request_id, None, f"instance {sched.instance} does not serve {msg.model!r}")]
    if sched.active == msg.model:
        return [SwitchDone(msg.request_id, None)]
    sched.force_switch(msg.model)
    waiting.append((msg, sched.switch_count))  # not len(switches): that list keeps the last 16
    return []


def _switched(driver: Driver, waiting: list) -> list:
    """Answer admin switches whose switch has happened."""
    sched, done = driver.scheduler, []
    for item in list(waiting):
        msg, mark = item
        if sched.switch_count > mark and sched.active == msg.model:
            done.append(SwitchDone(msg.request_id, sched.switches[-1].to_dict()))
            waiting.remove(item)
    return done


def _serve(driver: Driver, conn: Connection) -> None:
    """Rank 0's loop: messages in, steps, outputs out."""
    last_stats = last_plan = 0.0
    keepalive = driver.executor.group.size > 1
    switches: list[tuple[SwitchModel, int]] = []  # admin switches waiting for their record
    try:
        while True:
            out: list = []
            timeout = 0 if driver.has_work else IDLE_POLL_S
            while conn.poll(timeout):
                msg = conn.recv()
                timeout = 0
                if isinstance(msg, InstanceCall):
                    out += driver.add(msg)
                elif isinstance(msg, CancelCall):
                    out += driver.cancel(msg.request_id)
                elif isinstance(msg, SwitchModel):
                    out += _force_switch(driver, msg, switches)
                elif isinstance(msg, Shutdown):
                    driver.stop()
                    return
            now = time.monotonic()
            if driver.has_work or switches:
                out += driver.step()
                last_plan = now
            elif keepalive and now - last_plan >= KEEPALIVE_S:
                driver.executor.keepalive()
                last_plan = now
            out += _switched(driver, switches)
            out += driver.scheduler.drain_events()
            if now - last_stats >= STATS_EVERY_S:
                out.append(driver.stats())
                last_stats = now
            if out:
                conn.send(out)
    except (EOFError, BrokenPipeError):
        os._exit(0)  # the supervisor is gone: nobody to serve
    except Exception:  # noqa: BLE001 -- the group's state is unknown: exit, the supervisor fails its calls and restarts it
        traceback.print_exc()
        os._exit(1)
