"""The entry point of one engine-group worker process (spawned by talaria.node.engine_group).

This module is imported by the supervisor to name the spawn target, so it imports no torch: the
worker process imports the executor (and with it torch) only once it runs, after it has arranged to
die with its parent. What the rank then does is `talaria.executor.rank_loop`.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection

from talaria.config.schema import InstanceConfig
from talaria.executor.probes import Probes
from talaria.memory.rank_ledger import TestOnlyFault
from talaria.models.source import ModelFiles


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    instance: InstanceConfig
    models: tuple[ModelFiles, ...]
    rank: int
    rendezvous: str  # the group's FileStore: a file in a folder private to the supervisor
    threads: int
    fault: TestOnlyFault | None = None  # tests only: corrupt one rank's HKVR agreement reports
    probes: Probes | None = None  # `talaria profile`: calibrate with these, whatever the config says


def worker_main(spec: WorkerSpec, conn: Connection | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when we stop
    _die_with_parent()
    from talaria.executor.rank_loop import run_rank  # torch, in the worker only

    run_rank(spec.instance, list(spec.models), spec.rank, spec.rendezvous, spec.threads, conn,
             spec.fault, spec.probes)


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the supervisor dies, even by SIGKILL, so no worker is orphaned."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
