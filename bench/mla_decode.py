"""The MLA row of bench/engine.py: one multi-head latent attention layer at GLM-5's dims decoding one
sequence at context 8,192, the engine's latent-direct decode against expanding the cached latents
into every head's keys and values each step, on the same cache and the same torch threads; and the
cache bytes a token costs a rank, GLM-5's beside a GQA model's of comparable size.

Both forms are the engine's own code on the engine's own objects (talaria/executor/mla.py): the
latents sit in a `KVCache` of the layer's layout (a page holds the latent and the indexer's key of
its tokens, so the latent view is strided as in the arena), the step's `DecodeBatch` comes from
`AttentionMeta.build` on a one-token chunk, and
- latent-direct is `MLA._decode`, what a decode step runs: W_UK absorbed into the query, scores over
  the 576 cached numbers of each token, W_UV applied to the latent output;
- expanded is what `MLA.forward` runs for a prompt chunk over cached pages, with this step's one
  query: the context gathered from its pages, then `MLA._prefill` (kv_b_proj on every token, then
  ordinary attention; its mask is the one `AttentionMeta.build` gives a chunk at the end of its
  context, every token visible).
The query projections, the latent's write and o_proj are the same in both and are not timed.

Dims: GLM-5 at TP 1 (bench/gpu_shapes.py GLM5): 64 heads, q/k of 192 nope + 64 rope, v 256,
latent 512. Inputs are drawn as the projections of unit-RMS hidden states through weights of
1/sqrt(fan_in) scale would give them: the latent and the rope key standard normal (kv_a_layernorm
leaves the latent at unit RMS), each head's query standard normal, kv_b_proj normal of std
512^-0.5; the softmax scale is the model's (192 + 64)^-0.5. They are drawn in float64 and rounded
to float32 for the timed steps. The indexer is not run: at one query the selection only masks the
same scores in both forms.

Speed in float32, the median of STEPS steps of each form per run; agreement in float64 on the same
workload, where both are exact up to summation order: the largest absolute difference of the
outputs (the float32 difference is recorded too). Cache bytes from `kv_layout(arch, tp, 16,
"bfloat16").token_bytes` of each model's ModelArch, read from its config.json values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from gpu_shapes import GLM5  # bench/gpu_shapes.py, beside this script
from report import render  # bench/report.py

from talaria.contracts.arch import ModelArch
from talaria.contracts.kv_layout import kv_layout
from talaria.contracts.step_plan import SeqChunk, StepPlan
from talaria.executor.attention import AttentionMeta, _gather
from talaria.executor.kv_cache import KVCache
from talaria.executor.mla import MLA
from talaria.executor.parallel import Shard
from talaria.executor.rope import softmax_scale

# Qwen3-235B-A22B's config.json values that size its cache and parameters: 94 layers, 4 KV heads of 128
QWEN3_235B = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
              "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
              "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536,
              "max_position_embeddings": 40960}
CONTEXT = 8192
PAGE_SIZE = 16
STEPS = 3  # decode steps of each form per run: the median is kept
TOLERANCE = 1e-10  # float64: the largest |latent-direct - expanded| allowed
SEED = 0
TPS = (1, 8)  # the cache bytes are printed at these TP degrees
DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16"}


def layer_arch() -> ModelArch:
    """One GLM-5 layer: it runs the indexer, so its pages hold index_k beside the latent."""
    return ModelArch.from_hf_config(GLM5 | {"num_hidden_layers": 1})


@dataclass(frozen=True, slots=True)
class Workload:
    """One decoding sequence's MLA inputs at one layer, as `MLA.forward` hands them on."""

    q: torch.Tensor  # (1, heads, nope + rope): the step's query, its rope part rotated
    latent: torch.Tensor  # (n, latent + rope): what the cache holds for each context token
    kv_b: torch.Tensor  # (heads (nope + v), latent): kv_b_proj, each head's W_UK rows then W_UV rows

    @property
    def tokens(self) -> int:
        return self.latent.shape[0]

    def to(self, dtype: torch.dtype, device: torch.device | str | None = None) -> Workload:
        return Workload(*(getattr(self, f.name).to(device=device, dtype=dtype) for f in fields(self)))


def workload(n: int = CONTEXT) -> Workload:
    """A seeded float64 workload of context n."""
    a = layer_arch()
    gen = torch.Generator().manual_seed(SEED)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    kv_b = randn(a.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank) * a.kv_lora_rank ** -0.5
    return Workload(randn(1, a.num_heads, a.head_dim), randn(n, a.latent_dim), kv_b)


class Decode:
    """A workload as the engine holds it: its latents written to a KVCache's pages, the step's
    DecodeBatch, and the layer's MLA; each form is one decode step of it."""

    def __init__(self, w: Workload) -> None:
        arch, device = layer_arch(), w.q.device
        pages = -(-w.tokens // PAGE_SIZE)
        layout = kv_layout(arch, 1, PAGE_SIZE, DTYPE_NAMES[w.q.dtype])
        kv = KVCache(torch.zeros(pages + 1, layout.page_bytes, dtype=torch.uint8, device=device), layout)
        self.cache = kv.view("latent", 0)  # (pages + 1, page_size, latent + rope), strided
        pos = torch.arange(w.tokens, device=device)
        self.cache.index_put_((pos // PAGE_SIZE, pos % PAGE_SIZE), w.latent)  # as MLA.forward writes them
        plan = StepPlan("bench", (SeqChunk(0, (0,), w.tokens - 1, tuple(range(pages)), True),))
        (self.batch,) = AttentionMeta.build(plan, PAGE_SIZE, kv.null_page, device).decodes
        self.mla = MLA(Shard(0, 1, arch), softmax_scale(arch))
        self.q, self.tokens = w.q, w.tokens
        self.kv_b = w.kv_b.view(arch.num_heads, arch.qk_nope_head_dim + arch.v_head_dim, arch.kv_lora_rank)
        self.visible = torch.ones(1, w.tokens, dtype=torch.bool, device=device)  # (q_len, ctx)

    @torch.inference_mode()
    def latent_direct(self) -> torch.Tensor:
        """(1, heads, v): what a decode step runs."""
        return self.mla._decode(self.q, self.cache, self.batch, self.kv_b, None)

    @torch.inference_mode()
    def expanded(self) -> torch.Tensor:
        """(1, heads, v): what a prompt chunk over cached pages runs, for this one query."""
        ctx = _gather(self.cache, self.batch.pages, 1, self.tokens)[0]  # (n, latent + rope)
        return self.mla._prefill(self.q, ctx, self.visible, self.kv_b, None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(form: Callable[[], torch.Tensor], steps: int, device: torch.device) -> tuple[float, torch.Tensor]:
    """The median seconds of `steps` calls of `form`, and its output."""
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        out = form()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def warm_up(device: torch.device | str = "cpu") -> None:
    """Both forms once on a short context in both dtypes, so no timed step pays first-call costs."""
    for dtype in (torch.float32, torch.float64):
        d = Decode(workload(4 * PAGE_SIZE + 5).to(dtype, device))
        d.latent_direct()
        d.expanded()


def prepared(device: torch.device | str = "cpu") -> Decode:
    """The timed steps' input: the workload in float32, in the engine's cache."""
    return Decode(workload().to(torch.float32, device))


def speed_run(d: Decode, log, steps: int = STEPS) -> dict:
    """`steps` decode steps of `d` (float32) by each form; the ratio is expanded / latent-direct time."""
    device = d.q.device
    log(f"mla: latent-direct decode, context {d.tokens}, float32, {steps} steps")
    direct_s, o_direct = timed(d.latent_direct, steps, device)
    log(f"mla: expanded decode, context {d.tokens}, float32, {steps} steps")
    expanded_s, o_expanded = timed(d.expanded, steps, device)
    return {"mla_latent_s": direct_s, "mla_expanded_s": expanded_s, "mla_decode_speedup": expanded_s / direct_s,
            "mla_float32_max_diff": max_diff(o_direct, o_expanded)}


def token_bytes() -> dict:
    """Cache bytes one token costs a rank at each of TPS, bf16 in pages of 16: GLM-5 and Qwen3-235B-A22B."""
    archs = {"glm5": ModelArch.from_hf_config(GLM5), "qwen3_235b": ModelArch.from_hf_config(QWEN3_235B)}
    return {f"mla_token_bytes_{name}_tp{tp}": kv_layout(arch, tp, PAGE_SIZE, "bfloat16").token_bytes
            for name, arch in archs.items() for tp in TPS}


def agreement(log, device: torch.device | str = "cpu", tokens: int = CONTEXT) -> dict:
    """What the row records once: both forms on the whole workload in float64 (the largest
    difference, and the times for the record), and the cache bytes per token per rank."""
    d = Decode(workload(tokens).to(torch.float64, device))
    log(f"mla: float64 agreement, context {d.tokens}")
    direct_s, o_direct = timed(d.latent_direct, 1, d.q.device)
    expanded_s, o_expanded = timed(d.expanded, 1, d.q.device)
    return {"mla_float64_tokens": d.tokens, "mla_float64_max_diff": max_diff(o_direct, o_expanded),
            "mla_float64_latent_s": direct_s, "mla_float64_expanded_s": expanded_s,
            "mla_output_max_abs": o_expanded.abs().max().item(), **token_bytes()}


def config() -> dict:
    a = layer_arch()
    return {"heads": a.num_heads, "q_lora_rank": a.q_lora_rank, "kv_lora_rank": a.kv_lora_rank,
            "qk_nope_head_dim": a.qk_nope_head_dim, "qk_rope_head_dim": a.qk_rope_head_dim,
            "v_head_dim": a.v_head_dim, "context_tokens": CONTEXT, "page_size": PAGE_SIZE, "steps": STEPS,
            "timed_dtype": "float32", "tolerance_float64": TOLERANCE, "seed": SEED,
            "dims_source": "GLM-5's config.json values as issue 29's brief quotes them (bench/gpu_shapes.py GLM5)",
            "gqa_model": QWEN3_235B}


def table(m: dict, runs: int) -> str:
    """The row's tables and their notes, from medians and the once-per-invocation values."""
    n = m["mla_float64_tokens"]
    speed = render([("MLA layer (GLM-5)", "latent-direct", "expanded", "ratio"),
                    (f"decode ms, 1 sequence, context {n}, fp32", f"{m['mla_latent_s'] * 1e3:.1f}",
                     f"{m['mla_expanded_s'] * 1e3:.1f}", f"{m['mla_decode_speedup']:.1f}"),
                    (f"fp64 max |diff|, context {n}", "-", "-", f"{m['mla_float64_max_diff']:.1e}")])
    glm, qwen = ([m[f"mla_token_bytes_{name}_tp{tp}"] for tp in TPS] for name in ("glm5", "qwen3_235b"))
    rows = [("cache bytes a token per rank, bf16", *(f"tp {tp}" for tp in TPS)),
            ("GLM-5 (78 layers: latent 576, index_k 128)", *(f"{b:,}" for b in glm)),
            ("Qwen3-235B-A22B (94 layers: 4 KV heads of 128)", *(f"{b:,}" for b in qwen)),
            ("GLM-5 / Qwen3-235B-A22B", *(f"{g / q:.2f}" for g, q in zip(glm, qwen)))]
    return (f"{speed}\n(one MLA layer, 64 heads, latent 512 + rope 64, TP 1; medians of {runs} runs of the median of "
            f"{STEPS} steps, ratio = expanded / latent-direct time, target >= 5; fp64 tolerance {TOLERANCE:.0e})\n\n"
            f"{render(rows)}\n(the latent is whole on every rank, so GLM-5's bytes do not fall with tp; "
            "a GQA KV head is replicated once tp exceeds the KV heads)")


def failure(m: dict) -> str | None:
    """Why the row fails (the float64 agreement), or None."""
    if m["mla_float64_max_diff"] <= TOLERANCE:
        return None
    return (f"the latent-direct MLA decode differs from the expanded one by {m['mla_float64_max_diff']:.2e} in "
            f"float64 (allowed {TOLERANCE:.0e})")


def main(argv: list[str] | None = None) -> int:
    """The row on one device: the float32 speed-up over --runs runs (the median), the float64
    agreement once; exit 1 when the agreement or the speed-up target (5x) is missed."""
    ap = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=CONTEXT, help="context length (a dry run: fewer)")
    ap.add_argument("--no-gate", action="store_true", help="exit 0 whether or not the 5x target is met")
    ap.add_argument("--json", type=Path, default=Path("bench/results/mla_decode.json"))
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device; use --device cpu")
    device = torch.device(args.device)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr)

    warm_up(device)
    d = Decode(workload(args.tokens).to(torch.float32, device))
    runs = [speed_run(d, log) for _ in range(args.runs)]
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out = {"device": args.device, "config": config(), "runs": runs, **medians, **agreement(log, device, args.tokens)}
    print(table(out, args.runs))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    problem = failure(out)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
    return 0 if problem is None and (out["mla_decode_speedup"] >= 5.0 or args.no_gate) else 1


if __name__ == "__main__":
    sys.exit(main())
