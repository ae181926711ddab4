"""Per-layer prefill and decode time of 8B-dense, 30B-A3B-MoE, Qwen3.5-122B-A10B and GLM-5 layer sets,
against the HBM floor.

    python bench/layer_floor.py [--device cuda|cpu] [--dtype D] [--tiny] [--shapes a,b] [--fp8]
                                [--repeats N] [--json PATH]

``--fp8`` packs the projections as an FP8 block-scaled checkpoint keeps them (128 x 128 blocks;
norms, routers and the embedding plain): the engine's quantized path (talaria/executor/quant.py),
its floor counting the packed bytes and their scales.

A few layers of each shape (bench/gpu_shapes.py) are built with weights drawn by torch on the
device — nothing is read from or written to disk — and run through the engine's own forward
(talaria/executor/llama.py: paged KV, SDPA attention, the MoE MLP where the shape has experts).
Per layer it measures:

* prefill: one prompt of P tokens into an empty cache;
* decode: B sequences of context C, one new token each, for several B.

The floor is the bytes a layer must move, over the device's copy bandwidth measured in the same
run (a copy of N bytes moves 2N: it reads and writes each byte). A layer's bytes are its weights —
for an MoE layer the attention, the router and only the experts the step's tokens were routed to,
counted from the routing of that step — plus the KV it reads (decode: every sequence's context)
or writes (prefill). A ratio of 1.0 is a layer that streams its bytes once at copy speed; decode
should come near it, prefill is compute-bound and lies far above. Timings are of the forward alone
(the step's attention metadata is built before), the median of --repeats runs, divided by the
layers; the forward's embedding and final norm are in them and are negligible.

The Qwen3.5 set (bench/gpu_shapes.py HYBRID) is 3 Gated DeltaNet layers and 1 gated attention
layer: a DeltaNet layer's bytes are its weights and each sequence's state, read and written once a
step (decode and prefill alike); the attention layer's are as above.

The GLM-5 set (bench/gpu_shapes.py MLA) is 2 MoE layers of GLM-5 (multi-head latent attention with
the sparse-attention indexer; 256 experts, top-8, a shared expert), its weights shaped by the
engine's `mla_shapes`. A layer's cache bytes are its `latent` and `index_k` (kv_layout): prefill
writes both for every token; a decoding sequence of context C must read the latents of the tokens
it attends to, min(C, index_topk), and, past index_topk, every token's index key for the indexer
to choose them (at C <= index_topk every token is chosen and the indexer does not score). The
engine reads all C latents and masks the unchosen, so past index_topk its ratio carries that
surplus. The set decodes at twice its index_topk (4,096; toy sizes: their context), so the
indexer runs.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from gpu_shapes import (  # bench/gpu_shapes.py, beside this script
    HYBRID,
    MLA,
    SHAPES,
    hybrid_arch,
    mla_arch,
    shape,
)
from report import ProgressLog, environment, render, write_json  # bench/report.py

from talaria.contracts.arch import ModelArch
from talaria.contracts.kv_layout import kv_layout
from talaria.contracts.step_plan import SeqChunk, StepPlan
from talaria.executor import cpu_kernels, moe
from talaria.executor.attention import AttentionMeta
from talaria.executor.deltanet import deltanet_shapes, segments
from talaria.executor.kv_cache import KVCache
from talaria.executor.llama import LlamaModel
from talaria.executor.mla import mla_shapes
from talaria.executor.parallel import Shard, TPGroup
from talaria.executor.quant import FP8, FP8_MAX, QWeight
from talaria.executor.weights import LayerWeights, ModelWeights
from talaria.models.synthetic import synthetic_arch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}
PAGE_SIZE = 16
FULL = {"prefill": 2048, "context": 2048, "batches": (1, 8, 32, 64), "copy_bytes": 1 << 30}
SMALL = {"prefill": 32, "context": 32, "batches": (1, 4), "copy_bytes": 16 << 20}  # --tiny


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` runs, after one untimed run."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes per second the device moves in a plain copy, counting each byte read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device, repeats)


# ---- a few layers, weights drawn on the device --------------------------------------------------

def build(arch: ModelArch, dtype: torch.dtype, device: torch.device, fp8: bool = False) -> LlamaModel:
    """`fp8`: the projections packed as an FP8 block-scaled checkpoint keeps them (128 x 128 blocks,
    talaria/executor/quant.py); norms, routers and the embedding plain."""
    g = torch.Generator(device=device).manual_seed(0)

    def plain(*shape: int) -> torch.Tensor:  # (..., out, in), scaled by 1/sqrt(in) like a real init
        return torch.randn(shape, generator=g, device=device, dtype=dtype).mul_(shape[-1] ** -0.5)

    def lin(*shape: int) -> torch.Tensor | QWeight:
        if not fp8:
            return plain(*shape)
        *lead, rows, cols = shape
        data = torch.randn(shape, generator=g, device=device).mul_(64).clamp_(-FP8_MAX, FP8_MAX)
        scale = torch.full((*lead, -(-rows // 128), -(-cols // 128)), cols ** -0.5 / 64, device=device)
        return QWeight(FP8, data.to(torch.float8_e4m3fn), scale, None, (128, 128), (0, 0))

    def norm(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    h, hd = arch.hidden_size, arch.head_dim
    q = arch.q_size * (2 if arch.attn_output_gate else 1)  # each head's query, then its output gate
    shard = Shard(0, 1, arch)
    layers = []
    for i in range(arch.num_layers):
        if arch.is_linear_layer(i):  # Gated DeltaNet: projections, conv; A = 1, dt_bias 0, norm 1
            qkv, z, b, a, conv, dt, a_log, nrm, out = deltanet_shapes(shard)
            lw = LayerWeights(norm(h), None, None, None, None, None, norm(h), la_qkv=lin(*qkv), la_z=lin(*z),
                              la_b=lin(*b), la_a=lin(*a), la_conv=lin(*conv), la_dt_bias=norm(*dt).zero_(),
                              la_A_log=norm(*a_log).zero_(), la_norm=norm(*nrm), la_out=lin(*out))
        elif arch.is_mla:  # the engine's MLA tensors (mla_shapes order); norms 1, the indexer's key norm's bias 0
            a_proj, q_b, kv_norm, kv_b, o_proj, *rest = mla_shapes(shard, i)
            mla = {"mla_a": lin(*a_proj), "mla_q_b": lin(*q_b), "mla_kv_norm": norm(*kv_norm), "mla_kv_b": lin(*kv_b)}
            if arch.q_lora_rank:
                mla["mla_q_norm"] = norm(*rest.pop(0))
            if arch.has_indexer(i):
                mla["idx_q"], mla["idx_k_norm"] = lin(*rest[0]), norm(rest[1][1]).repeat(2, 1)
                mla["idx_k_norm"][1].zero_()
            lw = LayerWeights(norm(h), None, None, None, None, lin(*o_proj), norm(h), **mla)
        else:
            lw = LayerWeights(input_norm=norm(h), qkv=lin(q + 2 * arch.kv_size, h), qkv_bias=None,
                              q_norm=norm(hd) if arch.qk_norm else None, k_norm=norm(hd) if arch.qk_norm else None,
                              o_proj=lin(h, arch.q_size), post_norm=norm(h))
        if arch.is_moe_layer(i):
            e, m = arch.num_experts, arch.moe_intermediate_size
            lw.router, lw.experts_gate_up, lw.experts_down = plain(e, h), lin(e, 2 * m, h), lin(e, h, m)
            if arch.router_scoring == "sigmoid":  # the selection bias: 0 chooses by the scores alone
                lw.router_bias = norm(e).zero_()
            if arch.shared_expert_intermediate_size:
                sh = arch.shared_expert_intermediate_size
                lw.shared_gate_up, lw.shared_down = lin(2 * sh, h), lin(h, sh)
                lw.shared_gate = plain(1, h) if arch.shared_expert_gated else None
        else:
            lw.gate_up, lw.down = lin(2 * arch.intermediate_size, h), lin(h, arch.intermediate_size)
        layers.append(lw)
    embed = plain(arch.vocab_size, h)
    weights = ModelWeights(embed=embed, layers=layers, norm=norm(h), lm_head=embed)
    return LlamaModel(arch, shard, weights, TPGroup(0, 1), dtype)


def nbytes(t: torch.Tensor | QWeight | None) -> int:
    if isinstance(t, QWeight):
        return sum(nbytes(x) for x in t.tensors())
    return 0 if t is None else t.numel() * t.element_size()


def layer_bytes(lw: LayerWeights, experts: int | None) -> int:
    """Weight bytes one step reads from layer `lw`: everything, or for an MoE layer the attention,
    the router and `experts` of its experts."""
    dense = sum(nbytes(getattr(lw, f)) for f in LayerWeights.__slots__ if f not in ("experts_gate_up", "experts_down"))
    if lw.experts_gate_up is None:
        return dense
    per_expert = (nbytes(lw.experts_gate_up) + nbytes(lw.experts_down)) // lw.experts_gate_up.shape[0]
    return dense + experts * per_expert


# ---- steps ---------------------------------------------------------------------------------------

def prefill_plan(tokens: int) -> StepPlan:
    pages = tuple(range(math.ceil(tokens / PAGE_SIZE)))
    return StepPlan("bench", (SeqChunk(0, tuple(i % 256 for i in range(tokens)), 0, pages, True, state_slot=0),))


def decode_plan(batch: int, context: int) -> StepPlan:
    n = math.ceil(context / PAGE_SIZE)
    return StepPlan("bench", tuple(SeqChunk(b, (b % 256,), context - 1, tuple(range(b * n, (b + 1) * n)), True,
                                            state_slot=b) for b in range(batch)))


class Layers:
    """The model, its paged KV, and a way to run a plan's forward and see its routing."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device, pages: int, seqs: int,
                 fp8: bool = False) -> None:
        self.arch, self.device = arch, device
        self.model = build(arch, dtype, device, fp8)
        self.layout = layout = kv_layout(arch, 1, PAGE_SIZE, str(dtype).removeprefix("torch."))
        states = torch.zeros((seqs, layout.state_bytes), dtype=torch.uint8, device=device) if layout.stateful else None
        self.kv = KVCache(torch.empty((pages + 1, layout.page_bytes), dtype=torch.uint8, device=device), layout,
                          states)
        for t in layout.tensors:  # random KV in every page but the null one, through the typed views
            for i in t.layers if t.per_token else ():
                self.kv.view(t.name, i)[:-1].normal_(0.0, 0.1)
        # bytes one token adds to the cache of layer i; bytes of one sequence's state of layer i
        self.token_bytes = [sum(t.nbytes for t in layout.tensors if t.per_token and i in t.layers)
                            for i in range(arch.num_layers)]
        self.state_bytes = [sum(t.nbytes for t in layout.tensors if not t.per_token and i in t.layers)
                            for i in range(arch.num_layers)]

    def read_bytes(self, layer: int, context: int) -> int:
        """Cache bytes a decoding sequence of `context` tokens must read from `layer`: every token's
        K and V (or latent); with sparse attention the latents of the index_topk tokens it attends
        to, and every token's index key where the layer's indexer scores them (past index_topk)."""
        a = self.arch
        if not a.indexer_types:
            return context * self.token_bytes[layer]
        scored = a.has_indexer(layer) and context > a.index_topk
        index = self.layout.tensor("index_k").nbytes if scored else 0
        return min(context, a.index_topk) * self.layout.tensor("latent").nbytes + context * index

    def step(self, plan: StepPlan):
        meta = AttentionMeta.build(plan, PAGE_SIZE, self.kv.null_page, self.device)
        ids = torch.tensor([t for c in plan.chunks for t in c.token_ids], device=self.device)
        pos = torch.tensor([p for c in plan.chunks for p in range(c.start_pos, c.context_len)], device=self.device)
        segs = segments(plan.chunks) if self.kv.states is not None else None
        return lambda: self.model.forward(ids, pos, meta, self.kv, segs)

    def routed(self, run) -> list[int | None]:
        """Distinct experts each layer's tokens go to in one run of `run` (None: a dense layer)."""
        seen: list[int] = []
        original = moe.route

        def recording(*args):
            experts, weights = original(*args)
            seen.append(int(experts.unique().numel()))
            return experts, weights
        moe.route, kernel = recording, cpu_kernels.MOE_EXPERTS
        cpu_kernels.MOE_EXPERTS = False  # the CPU kernel routes inside its call: this untimed run routes in torch
        try:
            run()
        finally:
            moe.route, cpu_kernels.MOE_EXPERTS = original, kernel
        it = iter(seen)
        return [next(it) if self.arch.is_moe_layer(i) else None for i in range(self.arch.num_layers)]

    def row(self, plan: StepPlan, cache: list[int], bandwidth: float, repeats: int) -> dict:
        """Timings of `plan`'s forward per layer against the floor of the bytes it moves: each layer's
        weights and the `cache` bytes it writes (prefill) or reads (decode), a number per layer."""
        run = self.step(plan)
        experts = self.routed(run) if self.arch.is_moe else [None] * self.arch.num_layers
        seqs = len(plan.chunks)  # each sequence's state is read and written once (DeltaNet layers)
        per_layer = [layer_bytes(lw, e) + kv + 2 * seqs * st
                     for lw, e, kv, st in zip(self.model.w.layers, experts, cache, self.state_bytes)]
        seconds = timed(run, self.device, repeats) / self.arch.num_layers
        floor = statistics.mean(per_layer) / bandwidth
        row = {"ms_per_layer": seconds * 1e3, "floor_ms_per_layer": floor * 1e3, "ratio": seconds / floor,
               "bytes_per_layer": statistics.mean(per_layer), "tokens": plan.num_tokens}
        if self.arch.is_moe:
            row["experts_per_layer"] = statistics.mean(e for e in experts if e is not None)
        return row


def decode_context(arch: ModelArch, sizes: dict) -> int:
    """The decode steps' context: the sizes', or past a sparse-attention set's index_topk (twice it),
    where its indexer chooses; at or below it every token is chosen and the indexer is skipped."""
    return max(sizes["context"], 2 * arch.index_topk)


def measure(name: str, arch: ModelArch, dtype: torch.dtype, device: torch.device, sizes: dict,
            bandwidth: float, repeats: int, log, fp8: bool = False) -> dict:
    c = decode_context(arch, sizes)
    pages = max(math.ceil(sizes["prefill"] / PAGE_SIZE), max(sizes["batches"]) * math.ceil(c / PAGE_SIZE))
    log(f"{name}: building {arch.num_layers} layers on {device} ({dtype}), {pages} KV pages")
    layers = Layers(arch, dtype, device, pages, max(sizes["batches"]), fp8)
    p = sizes["prefill"]
    log(f"{name}: prefill {p} tokens")
    prefill = layers.row(prefill_plan(p), [p * t for t in layers.token_bytes], bandwidth, repeats)
    decode = []
    for b in sizes["batches"]:
        log(f"{name}: decode batch {b} at context {c}")
        read = [b * layers.read_bytes(i, c) for i in range(arch.num_layers)]
        decode.append({"batch": b, "context": c, **layers.row(decode_plan(b, c), read, bandwidth, repeats)})
    dims = {k: getattr(arch, k) for k in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                                          "num_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                          "layer_types", "linear_num_key_heads", "linear_num_value_heads",
                                          "kv_lora_rank", "qk_rope_head_dim", "indexer_types", "index_topk",
                                          "index_n_heads", "index_head_dim", "shared_expert_intermediate_size")}
    del layers
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"arch": dims, "family": arch.family, "dtype": str(dtype).removeprefix("torch."), "fp8_weights": fp8,
            "prefill": prefill, "decode": decode}


def layer_set(name: str, tiny: bool) -> ModelArch:
    """The ModelArch of shape or layer set `name` (bench/gpu_shapes.py)."""
    if name in HYBRID:
        return hybrid_arch(name, tiny)
    return mla_arch(name, tiny) if name in MLA else synthetic_arch(shape(name, tiny))


def table(results: dict) -> str:
    rows = [("shape, step", "ms/layer", "floor ms/layer", "ratio", "MiB/layer", "experts")]
    for name, r in results.items():
        steps = [(f"prefill {r['prefill']['tokens']}", r["prefill"])]
        steps += [(f"decode b{d['batch']} ctx {d['context']}", d) for d in r["decode"]]
        for label, s in steps:
            rows.append((f"{name}: {label}", f"{s['ms_per_layer']:.3f}", f"{s['floor_ms_per_layer']:.3f}",
                         f"{s['ratio']:.2f}", f"{s['bytes_per_layer'] / 2**20:.1f}",
                         f"{s['experts_per_layer']:.1f}" if "experts_per_layer" in s else "-"))
    return render(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--tiny", action="store_true", help="toy shapes and sizes (gpu_check.sh --dry-run)")
    known = (*SHAPES, *HYBRID, *MLA)
    ap.add_argument("--shapes", default=",".join(known), help=f"comma-separated, from: {', '.join(known)}")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per step (the median is kept)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    ap.add_argument("--json", type=Path, default=Path("bench/results/layer_floor.json"))
    ap.add_argument("--fp8", action="store_true", help="projections as FP8 block-scaled weights (128 x 128 blocks): "
                    "the engine's packed path, its floor the packed bytes")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device cuda: torch {torch.__version__} sees no CUDA device; use --device cpu --tiny")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    names = [n for n in args.shapes.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        ap.error(f"--shapes {args.shapes!r}: use names from {', '.join(known)}")
    log, load_start = ProgressLog(), os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
    sizes = SMALL if args.tiny else FULL
    bandwidth = copy_bandwidth(device, sizes["copy_bytes"], args.repeats)
    log(f"copy bandwidth: {bandwidth / 2**30:.1f} GiB/s (read + write)")
    results = {n: measure(n, layer_set(n, args.tiny), dtype, device, sizes, bandwidth, args.repeats, log, args.fp8)
               for n in names}
    print(table(results))
    print(f"(floor: bytes a layer moves / {bandwidth / 2**30:.1f} GiB/s measured copy bandwidth; ratio = time / floor)")
    write_json(args.json, {"device": args.device, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda"
                           else None, "tiny": args.tiny, "copy_bytes_per_s": bandwidth, "sizes": sizes,
                           "page_size": PAGE_SIZE, "shapes": results,
                           **environment(log, load_start)}, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
