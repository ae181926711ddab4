"""The DeltaNet row of bench/engine.py: one Gated DeltaNet layer's prefill of an 8,192-token prompt,
chunked (what the engine runs for prompt chunks) against the token-by-token recurrence (what it
runs for decode steps), on the same inputs and the same torch threads, the state starting at zero.

Dims: one layer of Qwen3.5-122B-A10B at TP 1, 16 query/key heads and 64 value heads, all of 128
(`linear_num_key_heads`, `linear_num_value_heads`, `linear_key_head_dim`, `linear_value_head_dim`).
The checkpoint's own config.json could not be read from here; 16 / 64 are what two independent
public configs of that checkpoint give (a 48-layer, hidden-3072 Qwen3.5-MoE of 256 experts).

Inputs are made as `deltanet_mixer` makes them from the projections, with random values: q and k
for the 16 key heads, L2-normalised, each repeated over its 4 value heads, q scaled by 128**-0.5;
v standard normal; beta = sigmoid(N(0, 1)); g = -A_h softplus(N(0, 1)) with each head's A_h
log-uniform in [1e-3, 1], so some heads forget within a chunk and others carry the state across the
whole prompt. They are drawn in float64 and rounded to float32 for the timed runs.

Speed is measured in float32, the dtype the engine runs the recurrence in; agreement in float64,
where both forms are exact up to rounding: the largest absolute difference of the outputs and of
the final states on the same workload (the float32 difference is recorded too).
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
import torch.nn.functional as F
from report import render  # bench/report.py, beside this script

from talaria.executor.deltanet import CHUNK, _l2norm, chunked, recurrent_step

KEY_HEADS, VALUE_HEADS, HEAD_DIM = 16, 64, 128  # Qwen3.5-122B-A10B's DeltaNet layers, TP 1
PROMPT_TOKENS = 8192
TOLERANCE = 1e-10  # float64: the largest |chunked - recurrence| allowed, outputs and final state
SEED = 0


@dataclass(frozen=True, slots=True)
class Workload:
    """One prompt's DeltaNet inputs, heads first, as `chunked` takes them."""

    q: torch.Tensor  # (Hv, n, dk): normalised, scaled by dk**-0.5
    k: torch.Tensor  # (Hv, n, dk): normalised
    v: torch.Tensor  # (Hv, n, dv)
    g: torch.Tensor  # (Hv, n): log decay, < 0
    beta: torch.Tensor  # (Hv, n): step size in (0, 1)

    @property
    def tokens(self) -> int:
        return self.v.shape[1]

    def to(self, dtype: torch.dtype, device: torch.device | str | None = None) -> Workload:
        return Workload(*(getattr(self, f.name).to(device=device, dtype=dtype) for f in fields(self)))


def workload(n: int = PROMPT_TOKENS) -> Workload:
    """A seeded float64 workload of n tokens."""
    gen = torch.Generator().manual_seed(SEED)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    rep = VALUE_HEADS // KEY_HEADS
    q = _l2norm(randn(KEY_HEADS, n, HEAD_DIM)).repeat_interleave(rep, dim=0) * HEAD_DIM ** -0.5
    k = _l2norm(randn(KEY_HEADS, n, HEAD_DIM)).repeat_interleave(rep, dim=0)
    rate = 10 ** torch.empty(VALUE_HEADS, 1, dtype=torch.float64).uniform_(-3, 0, generator=gen)  # A_h
    g = -rate * F.softplus(randn(VALUE_HEADS, n))
    return Workload(q, k, randn(VALUE_HEADS, n, HEAD_DIM), g, randn(VALUE_HEADS, n).sigmoid())


def by_chunks(w: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt through `chunked` from a zero state: o (Hv, n, dv) and the final state."""
    state = torch.zeros(VALUE_HEADS, HEAD_DIM, HEAD_DIM, dtype=w.v.dtype, device=w.v.device)
    return chunked(w.q, w.k, w.v, w.g, w.beta, state), state


def by_recurrence(w: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt through `recurrent_step`, one token at a time (B = 1), from a zero state."""
    state = torch.zeros(1, VALUE_HEADS, HEAD_DIM, HEAD_DIM, dtype=w.v.dtype, device=w.v.device)
    o = torch.empty_like(w.v)
    for t in range(w.tokens):
        o[:, t] = recurrent_step(w.q[None, :, t], w.k[None, :, t], w.v[None, :, t], w.g[None, :, t],
                                 w.beta[None, :, t], state)[0]
    return o, state[0]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(form: Callable[[Workload], tuple[torch.Tensor, torch.Tensor]], w: Workload):
    _sync(w.v.device)
    t0 = time.perf_counter()
    out = form(w)
    _sync(w.v.device)
    return time.perf_counter() - t0, out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def warm_up(device: torch.device | str = "cpu") -> None:
    """Both forms once on a short prompt in both dtypes, so no timed run pays first-call costs."""
    w = workload(2 * CHUNK + 5)
    for dtype in (torch.float32, torch.float64):
        by_chunks(w.to(dtype, device))
        by_recurrence(w.to(dtype, device))


def prepared(device: torch.device | str = "cpu") -> Workload:
    """The timed runs' input: the workload in float32."""
    return workload().to(torch.float32, device)


def speed_run(w: Workload, log) -> dict:
    """One timed prefill of `w` (float32) by each form; the ratio is recurrence / chunked time."""
    log(f"deltanet: chunked prefill, {w.tokens} tokens, float32")
    chunked_s, (o_chunked, s_chunked) = timed(by_chunks, w)
    log(f"deltanet: token-by-token recurrence, {w.tokens} tokens, float32")
    recurrent_s, (o_recurrent, s_recurrent) = timed(by_recurrence, w)
    return {"deltanet_chunked_s": chunked_s, "deltanet_recurrent_s": recurrent_s,
            "deltanet_prefill_speedup": recurrent_s / chunked_s,
            "deltanet_float32_max_diff": max(max_diff(o_chunked, o_recurrent), max_diff(s_chunked, s_recurrent))}


def agreement(log, device: torch.device | str = "cpu", tokens: int = PROMPT_TOKENS) -> dict:
    """Both forms on the whole workload in float64: the largest differences, and the times for the
    record."""
    w = workload(tokens).to(torch.float64, device)
    log(f"deltanet: float64 agreement, chunked, {w.tokens} tokens")
    chunked_s, (o_chunked, s_chunked) = timed(by_chunks, w)
    log(f"deltanet: float64 agreement, recurrence, {w.tokens} tokens")
    recurrent_s, (o_recurrent, s_recurrent) = timed(by_recurrence, w)
    return {"deltanet_float64_tokens": w.tokens, "deltanet_float64_max_diff": max_diff(o_chunked, o_recurrent),
            "deltanet_float64_state_max_diff": max_diff(s_chunked, s_recurrent),
            "deltanet_float64_chunked_s": chunked_s, "deltanet_float64_recurrent_s": recurrent_s,
            "deltanet_output_max_abs": o_recurrent.abs().max().item()}


def config() -> dict:
    return {"key_heads": KEY_HEADS, "value_heads": VALUE_HEADS, "key_head_dim": HEAD_DIM,
            "value_head_dim": HEAD_DIM, "prompt_tokens": PROMPT_TOKENS, "chunk_tokens": CHUNK, "timed_dtype": "float32",
            "tolerance_float64": TOLERANCE, "seed": SEED,
            "dims_source": "Qwen3.5-122B-A10B per two public configs of the checkpoint (its config.json not read)"}


def table(m: dict, runs: int) -> str:
    """The row's table and its note, from medians and the once-per-invocation values."""
    rows = render([("DeltaNet layer", "chunked", "recurrence", "ratio"),
                   (f"prefill s, {PROMPT_TOKENS} tokens, fp32", f"{m['deltanet_chunked_s']:.2f}",
                    f"{m['deltanet_recurrent_s']:.2f}", f"{m['deltanet_prefill_speedup']:.2f}"),
                   (f"fp64 max |diff|, {m['deltanet_float64_tokens']} tokens", "-", "-",
                    f"{m['deltanet_float64_max_diff']:.1e}")])
    return (f"{rows}\n(one Gated DeltaNet layer, {KEY_HEADS} key / {VALUE_HEADS} value heads of {HEAD_DIM} "
            f"(Qwen3.5-122B-A10B), zero initial state; medians of {runs} runs, ratio = recurrence / chunked time, "
            f"target >= 5; fp64: outputs, final state {m['deltanet_float64_state_max_diff']:.1e}, tolerance "
            f"{TOLERANCE:.0e})")


def failure(m: dict) -> str | None:
    """Why the row fails (the float64 agreement of outputs or final state), or None."""
    worst = max(m["deltanet_float64_max_diff"], m["deltanet_float64_state_max_diff"])
    if worst <= TOLERANCE:
        return None
    return (f"the chunked DeltaNet prefill differs from the recurrence by {worst:.2e} in float64 "
            f"(allowed {TOLERANCE:.0e})")


def main(argv: list[str] | None = None) -> int:
    """The row on one device (bench/gpu_check.sh runs it on CUDA): the float32 speed-up over --runs
    runs (the median), the float64 agreement once; exit 1 when the agreement or the speed-up target
    (5x) is missed."""
    ap = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=PROMPT_TOKENS, help="prompt length (a dry run: fewer)")
    ap.add_argument("--no-gate", action="store_true", help="exit 0 whether or not the 5x target is met")
    ap.add_argument("--json", type=Path, default=Path("bench/results/deltanet_prefill.json"))
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device; use --device cpu")
    device = torch.device(args.device)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr)

    warm_up(device)
    w = workload(args.tokens).to(torch.float32, device)
    runs = [speed_run(w, log) for _ in range(args.runs)]
    out = {"device": args.device, "config": config(), "runs": runs,
           "speedup_median": statistics.median(r["deltanet_prefill_speedup"] for r in runs),
           **agreement(log, device, args.tokens)}
    print(f"deltanet {args.device}: chunked {statistics.median(r['deltanet_chunked_s'] for r in runs):.3f} s, "
          f"recurrence {statistics.median(r['deltanet_recurrent_s'] for r in runs):.3f} s, "
          f"speed-up {out['speedup_median']:.2f} (target 5); float64 max diff {out['deltanet_float64_max_diff']:.1e}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    ok = out["deltanet_float64_max_diff"] <= TOLERANCE and (out["speedup_median"] >= 5.0 or args.no_gate)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
