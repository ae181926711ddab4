"""The node's supervisor: prepares model files, runs one EngineGroup per instance, stops them all.

Everything the gateway needs from the node goes through here: model names, tokenizers and
architectures, the groups serving a model, and the latest stats of each instance.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from talaria.config.schema import InstanceConfig, TalariaConfig
from talaria.contracts.arch import ModelArch
from talaria.contracts.telemetry import InstanceStats
from talaria.models.source import ModelFiles, prepare_model
from talaria.models.tokenizer import Tokenizer
from talaria.node.engine_group import EngineGroup
from talaria.node.event_log import EventLog

log = logging.getLogger("talaria.node")

Progress = Callable[[str, int, int], None]


def worker_threads(config: TalariaConfig, instance: InstanceConfig) -> int:
    """Torch threads per worker: the instance's setting, or the cores shared across all workers."""
    if instance.threads:
        return instance.threads
    workers = sum(i.tp for i in config.instances)
    return max(1, (os.cpu_count() or 1) // workers)


class Supervisor:
    def __init__(self, config: TalariaConfig, cache_dir: Path | None = None) -> None:
        self.config = config
        self.cache_dir = cache_dir
        self.files: dict[str, ModelFiles] = {}
        self._tokenizers: dict[str, Tokenizer] = {}
        self.groups: list[EngineGroup] = []
        tel = config.telemetry
        path = None
        if tel.events_path is not None:
            path = Path(tel.events_path).expanduser()
            if not path.is_absolute() and config.path is not None:
                path = config.path.parent / path
        self.events = EventLog(tel.events_buffer, path)

    def prepare(self, progress: Progress | None = None) -> None:
        """Resolve, convert (once, cached) and load the tokenizer of every model the instances use;
        with peers (listed or found by peer_dns), of every listed model (a model served only by a peer is
        tokenized here)."""
        base = self.config.path.parent if self.config.path else None
        used = {m for inst in self.config.instances for m in inst.models}
        if self.config.router.peers or self.config.router.peer_dns:
            used |= {m.name for m in self.config.models}
        for model in self.config.models:
            if model.name not in used:
                continue
            files = prepare_model(model, base, self.cache_dir, progress)
            self.files[model.name] = files
            self._tokenizers[model.name] = Tokenizer.load(files.directory)

    async def start(self) -> None:
        """Start every instance's engine group concurrently; raise if any cannot start."""
        if not self.files:
            self.prepare()
        self.groups = [EngineGroup(self._resolved(inst), [self.files[m] for m in inst.models],
                                   worker_threads(self.config, inst), on_events=self.events.append)
                       for inst in self.config.instances]
        results = await asyncio.gather(*(g.start() for g in self.groups), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.stop()
            raise errors[0]

    def _resolved(self, inst: InstanceConfig) -> InstanceConfig:
        """The instance with its profile path made absolute (relative paths are to the config)."""
        if inst.profile is None or self.config.path is None or Path(inst.profile).expanduser().is_absolute():
            return inst
        return replace(inst, profile=str(self.config.path.parent / Path(inst.profile).expanduser()))

    async def stop(self) -> None:
        await asyncio.gather(*(g.stop() for g in self.groups), return_exceptions=True)
        self.events.close()

    # ---- what the gateway asks -------------------------------------------------------------

    def model_names(self) -> list[str]:
        return list(self.files)

    def tokenizer(self, model: str) -> Tokenizer:
        return self._tokenizers[model]

    def arch(self, model: str) -> ModelArch:
        return self.files[model].arch

    def groups_for(self, model: str) -> list[EngineGroup]:
        return [g for g in self.groups if model in g.config.models]

    def stats(self) -> list[InstanceStats]:
        return [g.stats for g in self.groups if g.stats is not None]
