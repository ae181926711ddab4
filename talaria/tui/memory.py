"""Where each instance's memory goes, for the HBM panel.

The arena split is derived from telemetry: the snapshot's KV page counts, page size, each model's
page bytes and state slots (from its cache layout), active and staged model and staging coverage,
and the instance's cost profile (weight bytes per rank, and `device_bytes`, which is the arena's
size on CPU). A snapshot from before the layout descriptor has no page bytes: the profile's bytes
per token times the page size stand in. The layout it mirrors is talaria/memory/bump_layout.py:
weights at the low end, then the state slots of a model whose cache keeps per-sequence state,
runtime buffers at the high end, the KV pool between, and the next model's weights staged in the
pool's free tail. On CUDA the profile's `device_bytes` is the whole GPU, so the runtime region
cannot be told from free memory there.

Device totals come from this machine: NVML per GPU when it answers, psutil's RAM otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from talaria.contracts.profile import Profile
from talaria.contracts.telemetry import InstanceStats


@dataclass(frozen=True, slots=True)
class ArenaUsage:
    """One rank's arena, in bytes per region."""

    device: str  # cpu | cuda
    ranks: int  # every rank of the instance has the same split
    model: str  # the active model, whose weights and KV pool these are
    weights: int
    state: int  # the active model's state slots (live states and snapshots); 0 without per-sequence state
    kv_used: int
    staging: int  # the staged model's clean bytes in the pool's free tail
    kv_free: int
    runtime: int | None  # None when the arena's size is unknown (CUDA)
    staged_model: str | None
    coverage: float  # staging coverage of the staged model, 0-1
    page_bytes: int  # one KV page of the active model
    state_bytes: int  # one state slot of the active model; 0 = no per-sequence state

    @property
    def total(self) -> int:
        return self.weights + self.state + self.kv_used + self.staging + self.kv_free + (self.runtime or 0)

    def regions(self) -> list[tuple[str, int]]:
        """(name, bytes) in arena order, low addresses first; the state region only when there is one."""
        out = [("weights", self.weights)] + ([("state", self.state)] if self.state else [])
        out += [("kv", self.kv_used), ("staging", self.staging), ("free", self.kv_free)]
        return out + ([("runtime", self.runtime)] if self.runtime is not None else [])


def arena_usage(stats: InstanceStats, profile: Profile | None) -> ArenaUsage | None:
    """The split of `stats`' arena; None without a profile that knows the active model."""
    if profile is None or stats.active_model not in profile.models:
        return None
    model = stats.active_model
    active = profile.models[model]
    page = stats.page_bytes.get(model) or stats.page_size * active.token_bytes
    state_bytes = stats.state_bytes.get(model, 0)
    state = state_bytes * stats.state_slots.get(model, 0)
    pool, used = stats.kv_pages_total * page, stats.kv_pages_used * page
    staged = stats.substrate.get("staged_model")
    coverage = float(stats.substrate.get("staging_coverage", 0.0))
    staging = 0
    if staged in profile.models:
        staging = min(pool - used, int(coverage * profile.models[staged].weights_bytes))
    runtime = None
    if profile.device == "cpu":
        runtime = max(0, profile.device_bytes - active.weights_bytes - state - pool)
    return ArenaUsage(profile.device, profile.tp, model, active.weights_bytes, state, used, staging,
                      pool - used - staging, runtime, staged, coverage, page, state_bytes)


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One device of this machine: a GPU from NVML, or host RAM."""

    name: str
    used: int
    total: int


class DeviceProbe:
    """Reads this machine's device memory; NVML is tried once and dropped if it fails."""

    def __init__(self) -> None:
        self._nvml = _start_nvml()

    def read(self) -> tuple[DeviceMemory, ...]:
        if self._nvml is not None:
            try:
                return _gpus(self._nvml)
            except self._nvml.NVMLError:
                self._nvml = None  # the driver went away: fall back to RAM from now on
        vm = psutil.virtual_memory()
        return (DeviceMemory("RAM", vm.total - vm.available, vm.total),)


def _start_nvml():
    """The pynvml module, initialised, when a GPU driver answers; else None."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
    except pynvml.NVMLError:  # no driver library, no driver, no GPU: all mean "no NVML"
        return None
    return pynvml


def _gpus(nvml) -> tuple[DeviceMemory, ...]:
    out = []
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
        name = nvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        out.append(DeviceMemory(f"GPU{i} {name}", int(info.used), int(info.total)))
    return tuple(out)
