"""Model-switch latency and HKVR restore bandwidth, against copy ceilings measured in the same run.

    python bench/switch.py [--device cpu|cuda] [--json PATH] [--runs N] [--threads T]
                           [--chunk-mib M] [--restore-mib M] [--tiny] [--formats] [--no-gate]

Two synthetic Llama models (float32, a few hundred MiB each) share one cold instance, driven
in-process at TP=1 with the code a worker runs. Per run it measures:

* a staged switch A -> B: A serves a long greedy generation while B's weights are staged into A's
  KV tail one chunk per engine step; once the stager's coverage reaches 1.0 a forced switch opens B
  (path ``full_d2d``). The same switch on an instance with staging off (path ``h2d_only``), after
  as many serving steps. Both with the five phases of App. D, from the switch record;
* the HKVR restore: ``Substrate.before_step`` with restores of ``--restore-mib`` MiB of KV pages
  from host slabs, the exact code a step runs before its forward;
* the ceilings: a single large ``copy_`` of the same byte count, host memcpy on CPU; on CUDA a
  device-to-device copy and a pinned host-to-device copy.

Per checkpoint format (issue 31), one Qwen3-MoE (hidden 512, 4 layers, 8 experts of width 256) is
written by tests/quantized.py as a plain, an FP8 (blocks of 128x128) and an NVFP4 checkpoint and
served in bfloat16 as the target of the same two switches, after a small bf16 model: its weights
image per rank and the bytes each switch moves (H2D with staging off, D2D when staged), from the
switch records. A packed image must shrink both alike. ``--formats`` runs this part, and only it
(it needs transformers, and its first run calibrates three models: a minute or two on a CPU).

``--tiny`` swaps in toy models and copies of a few hundred KiB (``bench/gpu_check.sh --dry-run``):
every step runs, the figures mean nothing.

Machines are noisy, so rates are compared as fractions of a ceiling measured in the same run, and
the median over ``--runs`` runs is reported. The target is ``restore_fraction`` >= 0.7 (the restore
rate over the ceiling copy's); the script exits 1 when it is missed, except with ``--no-gate`` (to
explore) or ``--tiny`` (whose figures mean nothing), and always when a switch took another path than
the one it measures. Progress goes to stderr, the tables to stdout, everything (with every run's
switch records) to the JSON file.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests/ (and talaria) from here

import torch
from report import (  # bench/report.py, beside this script
    ProgressLog,
    add_gate_flag,
    environment,
    gate,
    render,
    write_json,
)

from talaria.config.schema import (
    Device,
    InstanceConfig,
    ModelConfig,
    Pool,
    SyntheticShape,
)
from talaria.contracts.call import FinishReason, InstanceCall, SamplingParams
from talaria.contracts.kv_layout import kv_layout
from talaria.contracts.step_plan import MemoryOps
from talaria.contracts.vocabulary import SwitchPath
from talaria.executor.driver import Driver, start_driver
from talaria.executor.executor import Executor
from talaria.executor.parallel import Shard, TPGroup
from talaria.executor.substrate import DTYPES
from talaria.executor.weights import weights_nbytes
from talaria.memory.switch_record import PHASES, SwitchRecord
from talaria.models.source import ModelFiles, prepare_model

# A (~349 MiB) serves first; B (~317 MiB, another KV page size) is the switch target
MODEL_A = ModelConfig(name="switch-a", source="synthetic:", dtype="float32", seed=1, shape=SyntheticShape(
    hidden_size=1024, intermediate_size=1536, num_layers=8, num_heads=16, num_kv_heads=4, vocab_size=32000,
    max_position=2048, tie_word_embeddings=True))
MODEL_B = ModelConfig(name="switch-b", source="synthetic:", dtype="float32", seed=2, shape=SyntheticShape(
    hidden_size=1024, intermediate_size=1024, num_layers=8, num_heads=16, num_kv_heads=8, vocab_size=32000,
    max_position=2048, tie_word_embeddings=True))
# --tiny: the same two-model structure at toy sizes (B ~0.6 MiB: a dozen 64 KiB staging chunks)
TINY_A = ModelConfig(name="switch-tiny-a", source="synthetic:", dtype="float32", seed=1, shape=SyntheticShape(
    hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512,
    max_position=2048, tie_word_embeddings=True))
TINY_B = ModelConfig(name="switch-tiny-b", source="synthetic:", dtype="float32", seed=2, shape=SyntheticShape(
    hidden_size=128, intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=4, vocab_size=512,
    max_position=2048, tie_word_embeddings=True))
TINY_CHUNK_BYTES, TINY_RESTORE_BYTES = 64 << 10, 512 << 10
PAGE_SIZE = 16
KV_MARGIN = 128 << 20  # arena beyond both weight images: A's serving pages below B's staged image
PROMPT_TOKENS = 32
SERVE = SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True)  # outlives staging
COPY_REPS = 3  # restore and ceiling copies per run, interleaved; the run keeps their median
GIB = 1 << 30
TARGETS = {"restore_fraction": 0.7}


def gib_s(nbytes: int, seconds: float) -> float:
    return nbytes / GIB / seconds


def weight_bytes(files: ModelFiles) -> int:
    return weights_nbytes(Shard(0, 1, files.arch), DTYPES[files.dtype], files.directory)


def page_bytes(files: ModelFiles) -> int:
    return kv_layout(files.arch, 1, PAGE_SIZE, files.dtype).page_bytes


# ---- the engine ----------------------------------------------------------------------------------

def build_core(a: ModelFiles, b: ModelFiles, device: str, chunk_bytes: int, restore_pages: int) -> Driver:
    """A cold instance serving A then B, A open; slabs filled so restores read real memory."""
    slab = max(page_bytes(a), page_bytes(b))
    instance = InstanceConfig(name=f"bench-{'staged' if chunk_bytes else 'h2d'}", pool=Pool.COLD,
                              models=(a.name, b.name), device=Device(device),
                              arena_bytes=weight_bytes(a) + weight_bytes(b) + KV_MARGIN, page_size=PAGE_SIZE,
                              host_kv_bytes=(restore_pages + 64) * slab, staging_chunk_bytes=chunk_bytes,
                              ttft_s=3600.0)  # rounds so long that only forced switches happen
    gc.collect()
    core = start_driver(Executor(instance, [a, b], TPGroup(0, 1)))
    core.executor.substrate.slabs.fill_(0x5A)  # an untouched slab would read the zero page and flatter the restore
    return core


def check(outputs, what: str) -> None:
    for out in outputs:
        if out.finish is FinishReason.ERROR:
            raise RuntimeError(f"{what}: request {out.request_id} failed: {out.error}")


def switch_to(core: Driver, model: str) -> SwitchRecord:
    """Force a switch and run it: the next step executes the SwitchPlan."""
    before = core.scheduler.switches[-1] if core.scheduler.switches else None
    core.scheduler.force_switch(model)
    check(core.step(), f"switch to {model}")
    record = core.scheduler.switches[-1] if core.scheduler.switches else None
    if record is None or record is before or record.to_model != model:
        raise RuntimeError(f"forced switch to {model!r} left no switch record (active: {core.scheduler.active})")
    return record


def warm_up(core: Driver, a: str, b: str) -> None:
    """Open B once and come back, so measured switches hit cached runtime state; run A's forward."""
    switch_to(core, b)
    switch_to(core, a)
    check(core.add(InstanceCall("warm", a, tuple(range(PROMPT_TOKENS)), SamplingParams(max_tokens=4))), "warm-up")
    while core.has_work:
        check(core.step(), "warm-up")


def serve_then_switch(core: Driver, a: str, b: str, run: int, steps: int | None,
                      log) -> tuple[SwitchRecord, int, float]:
    """A serves a long generation for `steps` steps (None: until B is fully staged), then A -> B.

    Returns the switch record, the serving steps and their mean wall time in ms. Afterwards A is
    active again and idle, ready for the next run.
    """
    rng = random.Random(run)  # a fresh prompt per run: no prefix hits on an earlier run's pages
    rid = f"serve-{run}"
    check(core.add(InstanceCall(rid, a, tuple(rng.randrange(256) for _ in range(PROMPT_TOKENS)), SERVE)), rid)
    stager = core.scheduler.memory.stager
    cap = SERVE.max_tokens - 1
    n, t0 = 0, time.perf_counter()
    while (stager.coverage() < 1.0) if steps is None else (n < steps):
        if n >= cap:
            raise RuntimeError(f"staging of {b!r} reached only {stager.coverage():.0%} after {n} serving steps; "
                               "the KV tail is too small for its image (raise KV_MARGIN) or staging is stuck")
        outputs = core.step()
        check(outputs, rid)
        if any(o.finish is not None for o in outputs):
            raise RuntimeError(f"{rid} finished after {n + 1} steps, before the switch; raise SERVE.max_tokens")
        n += 1
    step_ms = (time.perf_counter() - t0) * 1e3 / max(n, 1)
    log(f"  {core.executor.instance.name}: {n} serving steps ({step_ms:.0f} ms each), switching {a} -> {b}")
    record = switch_to(core, b)  # A's generation is preempted: its KV is saved to host in phase 1
    check(core.cancel(rid), rid)
    switch_to(core, a)  # back, not measured
    for _ in range(100):
        if not core.has_work:
            break
        check(core.step(), "settle")
    return record, n, step_ms


def restore_ops(core: Driver, nbytes: int, run: int) -> tuple[MemoryOps, int]:
    """Restores of nbytes of KV: active pages 0..N-1 from shuffled slabs, as a continuation's would be."""
    sub = core.executor.substrate
    pb = sub.images[sub.active].layout.page_bytes
    n = nbytes // pb
    if n > sub.plan.num_pages or n > sub.num_slabs:
        raise RuntimeError(f"--restore-mib needs {n} pages; the pool has {sub.plan.num_pages} and the host "
                           f"{sub.num_slabs} slabs: lower --restore-mib")
    slabs = random.Random(run).sample(range(sub.num_slabs), n)
    return MemoryOps(restores=tuple(zip(slabs, range(n)))), n * pb


# ---- ceilings --------------------------------------------------------------------------------------

class Ceilings:
    """Plain copies of one byte count: host memcpy on CPU; device-to-device and pinned H2D on CUDA."""

    def __init__(self, device: str, nbytes: int) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.nbytes = nbytes
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device).fill_(1)
        self.src = torch.empty(nbytes, dtype=torch.uint8, device=self.device).fill_(2)
        if self.cuda:
            self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(3)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time(self, fn) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def memcpy(self) -> float:
        """GiB/s of one same-device copy (CUDA: device-to-device)."""
        return gib_s(self.nbytes, self.time(lambda: self.dst.copy_(self.src)))

    def h2d(self) -> float | None:
        """GiB/s of one pinned host-to-device copy; None on CPU, where it is the memcpy."""
        if not self.cuda:
            return None
        return gib_s(self.nbytes, self.time(lambda: self.dst.copy_(self.host, non_blocking=True)))


# ---- one run ---------------------------------------------------------------------------------------

def switch_row(record: SwitchRecord, expect: SwitchPath) -> dict:
    if record.path is not expect:
        raise RuntimeError(f"switch {record.from_model} -> {record.to_model} took path {record.path.value}, "
                           f"expected {expect.value}: {record.to_dict()}")
    rank = record.ranks[0]
    return {"total_ms": record.total_ms, "phase_ms": dict(zip((p.value for p in PHASES), rank.phase_ms)),
            "staged_bytes": rank.staged_bytes, "h2d_bytes": rank.total_bytes - rank.staged_bytes,
            "record": record.to_dict()}


def one_run(staged: Driver, plain: Driver, ceil: Ceilings, a: str, b: str, run: int,
            restore_bytes: int, log) -> dict:
    rec, steps, staged_step_ms = serve_then_switch(staged, a, b, run, None, log)
    d2d = switch_row(rec, SwitchPath.FULL_D2D)
    rec, _, plain_step_ms = serve_then_switch(plain, a, b, run, steps, log)
    h2d = switch_row(rec, SwitchPath.H2D_ONLY)

    log(f"  restore {restore_bytes / 2**20:g} MiB of KV pages and ceiling copies, {COPY_REPS}x each")
    ops, nbytes = restore_ops(plain, restore_bytes, run)
    plain.executor.substrate.before_step(ops)  # untimed: faults in the destination pages
    restore, memcpy, h2d_ceiling = [], [], []
    for _ in range(COPY_REPS):
        restore.append(gib_s(nbytes, ceil.time(lambda: plain.executor.substrate.before_step(ops))))
        memcpy.append(ceil.memcpy())
        h2d_ceiling.append(ceil.h2d())
    memcpy_gib_s = statistics.median(memcpy)
    h2d_ceiling_gib_s = statistics.median(h2d_ceiling) if ceil.cuda else memcpy_gib_s
    restore_gib_s = statistics.median(restore)

    d2d_open_s = d2d["phase_ms"]["open_weights"] / 1e3
    h2d_open_s = h2d["phase_ms"]["open_weights"] / 1e3
    d2d_gather = gib_s(d2d["staged_bytes"], d2d_open_s)
    h2d_rate = gib_s(h2d["h2d_bytes"], h2d_open_s)
    return {
        "switch_d2d_ms": d2d["total_ms"], "switch_h2d_ms": h2d["total_ms"],
        **{f"switch_d2d_{p}_ms": ms for p, ms in d2d["phase_ms"].items()},
        **{f"switch_h2d_{p}_ms": ms for p, ms in h2d["phase_ms"].items()},
        "memcpy_gib_s": memcpy_gib_s, "h2d_ceiling_gib_s": h2d_ceiling_gib_s, "restore_gib_s": restore_gib_s,
        "restore_fraction": restore_gib_s / h2d_ceiling_gib_s,
        "d2d_gather_gib_s": d2d_gather, "d2d_gather_fraction": d2d_gather / memcpy_gib_s,
        "h2d_gib_s": h2d_rate, "h2d_fraction": h2d_rate / h2d_ceiling_gib_s,
        "staging_speedup": h2d["total_ms"] / d2d["total_ms"],
        "open_weights_speedup": h2d_open_s / d2d_open_s,
        "serve_step_ms_staging": staged_step_ms, "serve_step_ms_plain": plain_step_ms,
        "staging_steps": steps, "load_1m": os.getloadavg()[0],
        "restore_copies_gib_s": restore, "memcpy_copies_gib_s": memcpy,
        "switch_d2d": d2d["record"], "switch_h2d": h2d["record"],
    }


# ---- per checkpoint format -------------------------------------------------------------------------

# One Qwen3-MoE (layer 0 dense, then 8 experts of width 256, top-2) in every format; its vocabulary
# is small, so embeddings and lm_head, never quantized, are ~7% of the parameters (Qwen3-30B-A3B: ~2%)
FORMAT_MOE = {"vocab_size": 1024, "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
              "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [0], "norm_topk_prob": True,
              "max_position_embeddings": 2048, "eos_token_id": None, "bos_token_id": None}
TINY_FORMAT_MOE = FORMAT_MOE | {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
                                "moe_intermediate_size": 32, "num_hidden_layers": 2, "head_dim": 16}
FP8_BLOCK = (128, 128)
FORMATS = ("plain", "fp8", "nvfp4")  # plain: the same writer with every module excluded
FORMAT_SERVE = "bfloat16"
# the model served before each switch: small, so its serving steps cost little
FORMAT_A = dataclasses.replace(TINY_A, name="switch-fmt-a", dtype=FORMAT_SERVE)


def write_checkpoints(root: Path, shape: dict) -> dict[str, Path]:
    """The one float64 Qwen3-MoE written as each format's checkpoint directory under root."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from tests.quantized import quantize_checkpoint

    torch.manual_seed(0)  # transformers draws the initial weights from the global generator
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**shape), dtype=torch.float64,
                                             experts_implementation="eager").eval()
    dirs = {}
    for fmt in FORMATS:
        dirs[fmt] = root / fmt
        quantize_checkpoint(model, dirs[fmt], "fp8" if fmt == "plain" else fmt, block=FP8_BLOCK,
                            exclude=("*",) if fmt == "plain" else ())
    return dirs


def format_row(a: ModelFiles, b: ModelFiles, device: str, chunk_bytes: int, log) -> dict:
    """B's image per rank and the bytes of a staged (full_d2d) and an unstaged (h2d_only) switch A -> B."""
    staged = build_core(a, b, device, chunk_bytes, 0)
    plain = build_core(a, b, device, 0, 0)
    rec, steps, _ = serve_then_switch(staged, a.name, b.name, 0, None, log)
    d2d = switch_row(rec, SwitchPath.FULL_D2D)
    rec, _, _ = serve_then_switch(plain, a.name, b.name, 0, steps, log)
    h2d = switch_row(rec, SwitchPath.H2D_ONLY)
    image = staged.executor.substrate.images[b.name].nbytes
    counted = weight_bytes(b)
    for what, rec in (("full_d2d", d2d["record"]), ("h2d_only", h2d["record"])):
        if rec["ranks"][0]["total_bytes"] != image or counted != image:
            raise RuntimeError(f"{b.name}: the {what} switch moved an image of {rec['ranks'][0]['total_bytes']} "
                               f"bytes; the host image holds {image}, weights_nbytes counts {counted}")
    for core in (staged, plain):
        core.stop()
    return {"image_bytes": image, "weights_nbytes": counted, "h2d_bytes": h2d["h2d_bytes"],
            "h2d_staged_bytes": h2d["staged_bytes"], "d2d_bytes": d2d["staged_bytes"],
            "d2d_h2d_bytes": d2d["h2d_bytes"], "staging_steps": steps,
            "switch_d2d_ms": d2d["total_ms"], "switch_h2d_ms": h2d["total_ms"],
            "switch_d2d": d2d["record"], "switch_h2d": h2d["record"]}


def run_formats(device: str, chunk_bytes: int, tiny: bool, log) -> dict:
    """Each format's row, with its ratios to the plain checkpoint's."""
    shape = TINY_FORMAT_MOE if tiny else FORMAT_MOE
    a = prepare_model(FORMAT_A, None)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="talaria-switch-formats-") as tmp:
        log(f"formats: writing a Qwen3-MoE {shape['hidden_size']}x{shape['num_hidden_layers']} layers as "
            f"{', '.join(FORMATS)} checkpoints")
        dirs = write_checkpoints(Path(tmp), shape)
        for fmt, path in dirs.items():
            b = prepare_model(ModelConfig(name=f"switch-moe-{fmt}", source=str(path), dtype=FORMAT_SERVE), None)
            log(f"formats: {fmt}, {weight_bytes(b) / 2**20:.3g} MiB per rank in {FORMAT_SERVE}")
            rows[fmt] = format_row(a, b, device, chunk_bytes, log)
    for row in rows.values():
        row |= {f"{k}_ratio": row[k] / rows["plain"][k] for k in ("image_bytes", "h2d_bytes", "d2d_bytes")}
    return {"shape": shape, "fp8_block": list(FP8_BLOCK), "dtype": FORMAT_SERVE, "served_before": FORMAT_A.name,
            "staging_chunk_bytes": chunk_bytes, "rows": rows}


# ---- report ----------------------------------------------------------------------------------------

def tables(m: dict, cfg: dict) -> str:
    name_a, name_b = cfg["models"]
    wa, wb = (f"{cfg['weight_bytes'][n] / 2**20:.3g}" for n in (name_a, name_b))
    switch = [(f"switch {name_a} -> {name_b} ({wa} -> {wb} MiB), ms", "full_d2d", "h2d_only",
               "h2d/d2d")]
    for i, p in enumerate(PHASES, 1):
        d, h = m[f"switch_d2d_{p.value}_ms"], m[f"switch_h2d_{p.value}_ms"]
        switch.append((f"  phase {i} {p.value}", f"{d:.2f}", f"{h:.2f}", f"{h / d:.2f}" if d > 0 else "-"))
    switch.append(("  total", f"{m['switch_d2d_ms']:.2f}", f"{m['switch_h2d_ms']:.2f}", f"{m['staging_speedup']:.2f}"))
    switch.append((f"serving steps to stage {wb} MiB ({cfg['staging_chunks']} chunks)",
                   f"{m['staging_steps']:.0f}", "-", "-"))
    switch.append(("serving step while staging / not, ms", f"{m['serve_step_ms_staging']:.1f}",
                   f"{m['serve_step_ms_plain']:.1f}", "-"))
    ceiling = "device-to-device copy" if cfg["device"] == "cuda" else "memcpy"
    h2d_ceiling = "pinned H2D copy" if cfg["device"] == "cuda" else "memcpy"
    copies = [("copy", "GiB/s", "ceiling", "fraction"),
              (f"ceiling: {ceiling}, {cfg['restore_bytes'] / 2**20:g} MiB", f"{m['memcpy_gib_s']:.2f}", "-", "1.00")]
    if cfg["device"] == "cuda":
        copies.append((f"ceiling: {h2d_ceiling}, {cfg['restore_bytes'] / 2**20:g} MiB", f"{m['h2d_ceiling_gib_s']:.2f}",
                       "-", "1.00"))
    copies += [
        (f"HKVR restore, {cfg['restore_pages']} pages of {cfg['page_bytes'][name_a] >> 10} KiB",
         f"{m['restore_gib_s']:.2f}", h2d_ceiling, f"{m['restore_fraction']:.2f}"),
        (f"switch D2D gather ({wb} MiB, phase 2)", f"{m['d2d_gather_gib_s']:.2f}", ceiling,
         f"{m['d2d_gather_fraction']:.2f}"),
        (f"switch H2D open ({wb} MiB, phase 2)", f"{m['h2d_gib_s']:.2f}", h2d_ceiling, f"{m['h2d_fraction']:.2f}"),
    ]
    return render(switch) + "\n\n" + render(copies)


def formats_table(f: dict) -> str:
    s = f["shape"]
    rows = [(f"Qwen3-MoE {s['hidden_size']}x{s['num_hidden_layers']}, {s['num_experts']} experts of "
             f"{s['moe_intermediate_size']}, in {f['dtype']}", "image/rank, bytes", "ratio",
             "H2D switch, bytes", "ratio", "D2D switch, bytes", "ratio")]
    for fmt, r in f["rows"].items():
        name = f"fp8 {f['fp8_block'][0]}x{f['fp8_block'][1]}" if fmt == "fp8" else fmt
        rows.append((name, f"{r['image_bytes']:,}", f"{r['image_bytes_ratio']:.3f}", f"{r['h2d_bytes']:,}",
                     f"{r['h2d_bytes_ratio']:.3f}", f"{r['d2d_bytes']:,}", f"{r['d2d_bytes_ratio']:.3f}"))
    return render(rows)



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the arena lives")
    ap.add_argument("--json", type=Path, default=None, help="where to write results (default "
                    "bench/results/switch.json; with --formats, bench/results/switch_formats.json)")
    ap.add_argument("--runs", type=int, default=3, help="runs to take the median of (at least 3)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    ap.add_argument("--chunk-mib", type=int, default=16, help="staging chunk: one per serving step")
    ap.add_argument("--restore-mib", type=int, default=256, help="KV bytes per restore (at least 64: beyond caches)")
    ap.add_argument("--tiny", action="store_true", help="toy models and copies: a smoke run, the figures mean "
                    "nothing (overrides --chunk-mib and --restore-mib)")
    ap.add_argument("--formats", action="store_true", help="only the switch bytes per checkpoint format")
    add_gate_flag(ap)
    args = ap.parse_args(argv)
    if args.json is None:
        args.json = Path("bench/results/switch_formats.json" if args.formats else "bench/results/switch.json")
    if args.runs < 3:
        ap.error("--runs must be at least 3: the report is a median")
    if not args.tiny and (args.restore_mib < 64 or args.chunk_mib < 1):
        ap.error("--restore-mib must be at least 64 and --chunk-mib at least 1")
    models = (TINY_A, TINY_B) if args.tiny else (MODEL_A, MODEL_B)
    chunk_bytes = TINY_CHUNK_BYTES if args.tiny else args.chunk_mib << 20
    restore_bytes = TINY_RESTORE_BYTES if args.tiny else args.restore_mib << 20
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device cuda: torch {torch.__version__} sees no CUDA device")

    log = ProgressLog()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    if args.formats:
        formats = run_formats(args.device, chunk_bytes, args.tiny, log)
        print(formats_table(formats))
        write_json(args.json, {"formats": formats, "device": args.device, "threads": args.threads,
                               **environment(log, load_start)}, log)
        return 0
    files = []
    for cfg in models:
        log(f"preparing {cfg.name}: synthetic {cfg.shape.hidden_size}x{cfg.shape.num_layers} layers "
            "(generated once, then cached in ~/.cache/talaria)")
        files.append(prepare_model(cfg, None, progress=lambda stage, done, total: log(f"  {stage} {done}/{total}")))
    a, b = files
    restore_pages = restore_bytes // page_bytes(a)
    log(f"building two instances on {args.device} ({args.threads} threads, load average {load_start:.2f}): "
        f"staging in {chunk_bytes >> 10} KiB chunks, and staging off")
    staged = build_core(a, b, args.device, chunk_bytes, restore_pages)
    plain = build_core(a, b, args.device, 0, restore_pages)
    for core in (staged, plain):
        warm_up(core, a.name, b.name)
    ceil = Ceilings(args.device, restore_bytes)

    runs = []
    for r in range(args.runs):
        log(f"run {r + 1}/{args.runs}")
        runs.append(one_run(staged, plain, ceil, a.name, b.name, r, restore_bytes, log))
    for core in (staged, plain):
        core.stop()
    scalar = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    medians = {k: statistics.median(run[k] for run in runs) for k in scalar}
    config = {
        "device": args.device, "threads": args.threads, "runs": args.runs, "page_size": PAGE_SIZE,
        "staging_chunk_bytes": chunk_bytes, "tiny": args.tiny,
        "staging_chunks": -(-weight_bytes(b) // chunk_bytes), "restore_bytes": restore_bytes,
        "restore_pages": restore_pages, "arena_bytes": staged.executor.instance.arena_bytes,
        "host_kv_bytes": staged.executor.instance.host_kv_bytes,
        "models": {m.name: {"dtype": m.dtype, "seed": m.seed, "shape": dataclasses.asdict(m.shape)}
                   for m in models},
        "weight_bytes": {f.name: weight_bytes(f) for f in files},
        "page_bytes": {f.name: page_bytes(f) for f in files},
    }
    result = {
        **medians,
        **{f"switch_{k}_phase_ms": {p.value: medians[f"switch_{k}_{p.value}_ms"] for p in PHASES}
           for k in ("d2d", "h2d")},
        "targets": TARGETS,
        "runs": runs,
        "config": config,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        **environment(log, load_start),
    }
    print(tables(medians, config))
    print(f"(medians of {args.runs} runs; a fraction is a rate / the ceiling copy of the same run; "
          f"target restore_fraction >= {TARGETS['restore_fraction']})")
    write_json(args.json, result, log)
    missed = [f"{k} {medians[k]:.3f} < {v}" for k, v in TARGETS.items() if medians[k] < v]
    return gate(missed, [], args.no_gate or args.tiny)


if __name__ == "__main__":
    sys.exit(main())
