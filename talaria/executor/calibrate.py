"""Measure this machine's costs for a profile: prefill, decode, switches and copy bandwidth.

A cold instance needs predicted costs to budget its rounds. Without a profile file it calibrates at
start-up: rank 0 broadcasts probe steps through the engine group exactly as it broadcasts real steps
(so TP communication is in the numbers), times them, and fits the profile's curves. Probes use
scratch KV pages of a fresh pool and publish nothing, so no prefix cache or host KV state is left
behind. Each model is opened once by a full H2D switch, whose five-phase record becomes the
profile's `h2d_only` switch cost. With several models and staging on, each model is then opened
twice more from another one whose KV-pool tail holds its staged weights, through the same Stager
and switch the scheduler uses: all chunks staged (`full_d2d`) and half of them (`partial`). The
first model is active again at the end.
"""

from __future__ import annotations

import dataclasses
import platform
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import torch

from talaria.config.schema import Device
from talaria.contracts.profile import (
    PROFILE_SCHEMA,
    Bandwidth,
    ModelProfile,
    Profile,
    ProfileError,
    SwitchCost,
)
from talaria.contracts.profile_file import load_profile, save_profile
from talaria.contracts.step_plan import MemoryOps, SeqChunk, StepPlan, SwitchPlan
from talaria.contracts.vocabulary import SwitchPath
from talaria.executor.curve_fit import fit_decode, fit_prefill
from talaria.executor.probes import FULL, Probes
from talaria.instance.assembly import new_stager
from talaria.instance.memory_planner import full_h2d
from talaria.memory.bump_layout import Region
from talaria.memory.switch_record import SwitchRecord
from talaria.models.conversion_cache import default_cache_dir, fingerprint

if TYPE_CHECKING:
    from talaria.executor.executor import Executor

PROBE_ID = -1_000_000  # sequence ids of probes: below anything a scheduler hands out
PROFILE_CACHE_AGE_S = 7 * 24 * 3600.0  # a start-up profile is measured again after a week


def calibrate(executor: Executor, probes: Probes = FULL, method: str = "start-up calibration",
              progress: Callable[[str], None] = lambda line: None) -> Profile:
    """Rank 0 only, with every other rank in `follow()`: time the probes and fit a Profile.
    `progress` gets one line per stage (`talaria profile` prints them)."""
    sub, inst = executor.substrate, executor.instance
    names = list(sub.images)
    models = {}
    for i, name in enumerate(names, 1):
        progress(f"model {i}/{len(names)} {name}: open, prefill and decode probes")
        record = _open(executor, name) if name != sub.active else None
        models[name] = _model_profile(executor, name, probes, record)
    if sub.active != names[0]:
        record = _open(executor, names[0])
        models[names[0]] = _with_switch(models[names[0]], record)
    if probes.staged_switches and new_stager(inst, len(names)) is not None:
        progress("staged switches: full-D2D and partial opens of every model")
        for i, name in enumerate(names):
            source = names[i - 1]  # the model before it (the last one, for the first)
            for fraction, path in ((1.0, SwitchPath.FULL_D2D), (0.5, SwitchPath.PARTIAL)):
                if sub.active != source:
                    _open(executor, source)
                record = _staged_open(executor, name, fraction)
                if record is not None and record.ranks[0].path is path:
                    models[name] = _with_switch(models[name], record)
        if sub.active != names[0]:
            _open(executor, names[0])
    cuda = inst.device is Device.CUDA
    progress("copy bandwidth and HKVR restore")
    bandwidth = _bandwidth(sub.arena.device, probes.copy_bytes)
    bandwidth = dataclasses.replace(bandwidth, restore_bytes_per_s=_restore_rate(executor, probes))
    return Profile(
        hardware=_hardware(inst.device, torch.get_num_threads()),
        device=inst.device.value,
        tp=inst.tp,
        device_bytes=torch.cuda.get_device_properties(sub.arena.device).total_memory if cuda else inst.arena_bytes,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        method=method,
        bandwidth=bandwidth,
        models=models,
    )


def cached_calibration(executor: Executor, probes: Probes, max_age_s: float = PROFILE_CACHE_AGE_S) -> Profile:
    """`calibrate`, unless this machine measured the same instance shape and models recently.

    Start-up profiles are cached under the conversion cache (`$TALARIA_CACHE_DIR/profiles`), keyed
    by everything that moves the numbers: hardware, torch threads, the instance's shape, each
    model's files and dtype, and the probes. A restart then skips the probes; the live EWMA
    (`CostModel`) corrects whatever drift there is. `talaria profile` always measures.
    """
    inst, sub = executor.instance, executor.substrate
    key = fingerprint({
        "schema": PROFILE_SCHEMA, "hardware": _hardware(inst.device, torch.get_num_threads()),
        "threads": torch.get_num_threads(), "tp": inst.tp, "device": inst.device.value,
        "arena": inst.arena_bytes, "page": inst.page_size, "batch": inst.max_batch_tokens,
        "running": inst.max_running, "probes": repr(probes),
        # converted and synthetic models live in folders named by a content key; HF folders by their name
        "models": [(n, img.files.directory.name, repr(img.files.arch), img.files.dtype) for n, img in sub.images.items()],
    })
    path = default_cache_dir() / "profiles" / f"{key}.toml"
    try:
        if time.time() - path.stat().st_mtime < max_age_s:
            return load_profile(path)
    except (OSError, ProfileError):
        pass  # absent, old or unreadable: measure
    profile = calibrate(executor, probes)
    try:
        save_profile(profile, path)
    except OSError:
        pass  # a read-only cache only costs the next start its probes
    return profile


def _open(executor: Executor, name: str) -> SwitchRecord | None:
    plan = SwitchPlan(name, full_h2d(executor.substrate.images[name].nbytes))
    record, _ = executor.switch(plan)
    return record


def _staged_open(executor: Executor, name: str, fraction: float) -> SwitchRecord | None:
    """Stage `fraction` of `name`'s weight chunks into the active model's free KV-pool tail, with the
    scheduler's Stager and staging copies, then open `name` by the gather it plans (D2D for staged
    chunks, H2D for the rest). None when the pool's tail has no room for a single chunk."""
    sub = executor.substrate
    active = sub.active
    stager = new_stager(executor.instance, len(sub.images))
    stager.target(name, sub.images[name].nbytes, sub.layout.plan(active))
    for _ in range(max(1, round(stager.num_chunks * fraction))):
        chunk = stager.next_chunk(lambda pages: True)  # probes publish nothing: every page is free
        if chunk is None:
            break
        plan = StepPlan(active, (), MemoryOps(stage=(name, chunk.src.start, chunk.src.end,
                                                     chunk.dst.start, chunk.dst.end)))
        executor.run(plan)
        sub.wait_staging()
        stager.written(chunk)
    if stager.coverage() == 0:
        return None
    plan = SwitchPlan(name, stager.gather_plan(Region(0, sub.images[name].nbytes)))
    record, _ = executor.switch(plan)
    return record


def _with_switch(profile: ModelProfile, record: SwitchRecord | None) -> ModelProfile:
    """The profile with the switch cost of `record`'s path: its slowest rank's five phases."""
    if record is None:
        return profile
    slowest = max(record.ranks, key=lambda r: r.total_ms)
    path = slowest.path
    cost = SwitchCost(path, tuple(ms / 1000 for ms in slowest.phase_ms))
    how = "a full H2D open" if path is SwitchPath.H2D_ONLY else \
        f"an open with {slowest.staged_bytes} of {slowest.total_bytes} weight bytes staged"
    return dataclasses.replace(profile, switch={**profile.switch, path: cost},
                               sources={**profile.sources, f"switch.{path.value}": f"measured: {how} at calibration"})


def _model_profile(executor: Executor, name: str, probes: Probes, record: SwitchRecord | None) -> ModelProfile:
    sub, ps = executor.substrate, executor.instance.page_size
    # probes fit the KV pool and the model's context (its RoPE tables end there)
    capacity = min(sub.plan.num_pages * ps, sub.images[name].files.arch.max_position)
    limit = max(1, min(executor.instance.max_batch_tokens, capacity - ps))
    # the probe sizes that fit this instance; a tiny pool or step budget still gets two points
    sizes = [t for t in probes.prefill_tokens if t <= limit] or sorted({max(1, limit // 4), limit})
    prefill = []
    for n in sizes:
        prefill.append((n, 0, _time(executor, probes, [_chunk(executor, 0, 0, n)])))
    for cached in (c for c in probes.cached_tokens if c + ps <= capacity):
        for n in (t for t in sizes if cached + t <= capacity):
            _time(executor, probes, [_chunk(executor, 0, 0, cached)], repeats=0)  # its KV, for the probe
            prefill.append((n, cached, _time(executor, probes, [_chunk(executor, 0, cached, n)])))
    decode = []
    contexts = [c for c in probes.decode_contexts if c + 1 <= capacity] or [max(0, min(ps, capacity) - 1)]
    for ctx in contexts:
        for batch in probes.decode_batches:
            per_seq = -(-(ctx + 1) // ps)
            if decode and (batch * per_seq > sub.plan.num_pages or batch > executor.instance.max_running):
                continue  # (a batch of 1 always runs, so the fit has a point)
            seconds = _time(executor, probes, [_chunk(executor, i * per_seq, ctx, 1, seq=i) for i in range(batch)])
            decode.append((batch, batch * (ctx + 1), seconds))
    image = sub.images[name]
    measured = "measured: start-up probes through the engine group, fastest of runs"
    profile = ModelProfile(name, image.nbytes, image.layout.token_bytes, fit_prefill(prefill), fit_decode(decode),
                           {}, {"prefill": measured, "decode": measured}, state_bytes=image.layout.state_bytes)
    return _with_switch(profile, record)


def _chunk(executor: Executor, first_page: int, start: int, n: int, seq: int = 0) -> SeqChunk:
    """Probe sequence `seq`: tokens [start, start + n) on consecutive pages from `first_page`, and
    state slot `seq` when the model keeps per-sequence state (a probe times, whatever it holds)."""
    ps, vocab = executor.instance.page_size, executor.substrate.images[executor.substrate.active].files.arch.vocab_size
    pages = tuple(range(first_page, first_page + -(-(start + n) // ps)))
    tokens = tuple((7 * (start + i) + seq) % (vocab - 1) + 1 for i in range(n))
    slot = seq if executor.substrate.plan.num_state_slots else -1
    return SeqChunk(PROBE_ID - seq, tokens, start, pages, True, state_slot=slot)


def _time(executor: Executor, probes: Probes, chunks: list[SeqChunk], repeats: int | None = None) -> float:
    """Seconds of one probe step through the group: the fastest run after a warm-up. On a shared
    machine the slower runs measure the neighbours; the live EWMA corrects what remains."""
    plan = StepPlan(executor.substrate.active, tuple(chunks), MemoryOps(forget=tuple(c.seq_id for c in chunks)))
    runs = []
    for _ in range(1 + (probes.repeats if repeats is None else repeats)):
        t0 = time.perf_counter()
        logits, _ = executor.run(plan)
        if logits is not None and logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        runs.append(time.perf_counter() - t0)
    return min(runs[1:]) if len(runs) > 1 else runs[0]


def _restore_rate(executor: Executor, probes: Probes) -> float | None:
    """Bytes per second of an HKVR restore: the active model's pages refilled from shuffled host
    slabs by the op a step runs before its forward, on every rank. None without host KV."""
    sub = executor.substrate
    pages = min(sub.num_slabs, sub.plan.num_pages, max(1, probes.copy_bytes // sub.slab_bytes))
    if sub.num_slabs == 0 or pages == 0:
        return None
    slabs = list(range(pages))
    random.Random(0).shuffle(slabs)  # slabs come back in whatever order they were saved
    plan = StepPlan(sub.active, (), MemoryOps(restores=tuple(zip(slabs, range(pages)))))
    best = float("inf")
    for _ in range(1 + probes.repeats):
        t0 = time.perf_counter()
        executor.run(plan)
        best = min(best, time.perf_counter() - t0)
    return pages * sub.images[sub.active].layout.page_bytes / best


def _bandwidth(device: torch.device, nbytes: int) -> Bandwidth:
    """Copy rates: host memcpy on CPU; pinned H2D / D2H and D2D on CUDA. Best of three."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    other = torch.empty_like(host)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev2 = torch.empty_like(dev)

    def rate(dst: torch.Tensor, src: torch.Tensor) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        return nbytes / best

    if device.type != "cuda":
        memcpy = rate(other, host)
        return Bandwidth(memcpy, memcpy, memcpy)
    return Bandwidth(rate(dev, host), rate(host, dev), rate(dev2, dev))


def _hardware(device: Device, threads: int) -> str:
    if device is Device.CUDA:
        return f"cuda: {torch.cuda.get_device_name()}"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"cpu: {name}, {threads} threads"
