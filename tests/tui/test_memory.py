"""The arena split derived from a snapshot and a cost profile, and the device probe's fallbacks."""

from __future__ import annotations

import dataclasses

import pytest

from talaria.config.schema import Pool
from talaria.contracts.profile import (
    Bandwidth,
    DecodeCurve,
    ModelProfile,
    PrefillCurve,
    Profile,
)
from talaria.contracts.telemetry import InstanceStats
from talaria.tui import memory
from talaria.tui.memory import DeviceProbe, arena_usage


def model(name: str, weights: int, kv_per_token: int) -> ModelProfile:
    return ModelProfile(name, weights, kv_per_token, PrefillCurve(0.01, 1e-5), DecodeCurve(0.01, 1e-4), {})


PROFILE = Profile("cpu: test", "cpu", 2, 200_000, "2026-01-01T00:00:00+00:00", "test", Bandwidth(1e9, 1e9, 1e9),
                  {"a": model("a", 50_000, 64), "b": model("b", 20_000, 64)})
STATS = InstanceStats("cold-0", waiting=0, running=1, kv_pages_used=10, kv_pages_total=100, models=("a", "b"),
                      active_model="a", page_size=16, pool=Pool.COLD,
                      substrate={"staged_model": "b", "staging_coverage": 0.5})


def test_the_arena_splits_into_weights_kv_staging_free_and_runtime():
    arena = arena_usage(STATS, PROFILE)
    # pages of 16 tokens x 64 B: a pool of 100 pages is 102,400 B, 10 in use; half of b's 20,000 B staged
    assert arena.regions() == [("weights", 50_000), ("kv", 10_240), ("staging", 10_000), ("free", 82_160),
                               ("runtime", 47_600)]
    assert arena.total == PROFILE.device_bytes and arena.ranks == 2 and arena.model == "a"


def test_the_snapshots_page_bytes_size_the_pool_and_a_stateful_model_shows_its_state_slots():
    stats = dataclasses.replace(STATS, page_bytes={"a": 1280, "b": 1024}, state_bytes={"a": 500, "b": 0},
                                state_slots={"a": 8, "b": 0})
    arena = arena_usage(stats, PROFILE)
    # pages of 1,280 B (not 16 x 64): a pool of 128,000 B, 10 in use; 8 state slots of 500 B above the
    # weights; the runtime is what is left of the 200,000 B arena
    assert arena.regions() == [("weights", 50_000), ("state", 4_000), ("kv", 12_800), ("staging", 10_000),
                               ("free", 105_200), ("runtime", 18_000)]
    assert (arena.page_bytes, arena.state_bytes) == (1280, 500) and arena.total == PROFILE.device_bytes


def test_a_snapshot_without_page_bytes_prices_pages_from_the_profile():
    arena = arena_usage(STATS, PROFILE)
    assert (arena.page_bytes, arena.state_bytes, arena.state) == (16 * 64, 0, 0)


def test_on_cuda_the_runtime_region_is_unknown():
    arena = arena_usage(STATS, dataclasses.replace(PROFILE, device="cuda", device_bytes=80 << 30))
    assert arena.runtime is None and [r for r, _ in arena.regions()] == ["weights", "kv", "staging", "free"]


def test_no_split_without_a_profile_that_knows_the_active_model():
    assert arena_usage(STATS, None) is None
    assert arena_usage(dataclasses.replace(STATS, active_model="c"), PROFILE) is None


def test_without_nvml_the_probe_reports_ram(monkeypatch):
    monkeypatch.setattr(memory, "_start_nvml", lambda: None)
    (ram,) = DeviceProbe().read()
    assert ram.name == "RAM" and 0 < ram.used <= ram.total


class VanishingNvml:
    """An NVML whose driver answered at start-up and stops answering."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        self.calls = 0

    def nvmlDeviceGetCount(self) -> int:
        self.calls += 1
        raise self.NVMLError("driver gone")


def test_a_failing_nvml_falls_back_to_ram_for_good(monkeypatch):
    nvml = VanishingNvml()
    monkeypatch.setattr(memory, "_start_nvml", lambda: nvml)
    probe = DeviceProbe()
    assert [d.name for d in probe.read()] == ["RAM"]
    assert [d.name for d in probe.read()] == ["RAM"] and nvml.calls == 1


@pytest.mark.parametrize("name", [b"NVIDIA H200", "NVIDIA H200"])
def test_nvml_gpus_are_listed_with_their_memory(monkeypatch, name):
    class Info:
        used, total = 3 << 30, 141 << 30

    class Nvml:
        NVMLError = Exception

        def nvmlDeviceGetCount(self) -> int:
            return 2

        def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
            return i

        def nvmlDeviceGetMemoryInfo(self, handle: int) -> Info:
            return Info()

        def nvmlDeviceGetName(self, handle: int):
            return name

    monkeypatch.setattr(memory, "_start_nvml", lambda: Nvml())
    gpus = DeviceProbe().read()
    assert [(g.name, g.used, g.total) for g in gpus] == [("GPU0 NVIDIA H200", 3 << 30, 141 << 30),
                                                         ("GPU1 NVIDIA H200", 3 << 30, 141 << 30)]
