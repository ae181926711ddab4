"""MLA's host KV at TP > 1: each rank restoring its own whole copy of the latent pages, against each
rank restoring a 1/tp share and the ranks all-gathering the rest.

    python bench/mla_host_kv.py [--tp N] [--tokens T] [--runs R] [--json PATH]

An MLA model's latent is whole on every rank (docs/models.md), so a host KV registry that saves each
rank's pages from that rank holds tp copies of it. The alternative holds one: rank r saves 1/tp of
each page's bytes, and a restore copies its share from host memory and all-gathers the others' from
the other ranks. Which is better depends on the host-to-device copy rate against the ranks'
collective rate; this measures both on this machine, with the engine's own transport (a TP group of
`tp` worker processes over torch.distributed: gloo on CPU, as `talaria up` runs them), for GLM-5's
pages (78 layers, latent 576 + index key 128, bf16: 109,824 B a token a rank) of `--tokens` tokens.
Per run, each form's wall time is the slowest rank's; the median over --runs is reported with the
host bytes each form keeps. Progress goes to stderr, the table to stdout, everything to the JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from report import ProgressLog, environment, render, write_json  # bench/report.py, beside this script

GLM5_TOKEN_BYTES = 78 * (576 + 128) * 2  # kv_layout(GLM-5, tp, 16, "bfloat16").token_bytes, any tp


def rank_main(rank: int, tp: int, nbytes: int, runs: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    share = nbytes // tp
    gen = torch.Generator().manual_seed(0)  # the latent is the same on every rank: so are its pages
    host_full = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, generator=gen)  # this rank's own copy
    host_share = host_full[rank * share:(rank + 1) * share].clone()  # the alternative: its share only
    arena = torch.empty(nbytes, dtype=torch.uint8)
    times = {"own_copy": [], "share_and_gather": []}
    for _ in range(runs):
        dist.barrier()
        t = time.perf_counter()
        arena.copy_(host_full)
        times["own_copy"].append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        parts = list(arena[:share * tp].chunk(tp))
        parts[rank].copy_(host_share)
        dist.all_gather(parts, parts[rank].clone())
        times["share_and_gather"].append(time.perf_counter() - t)
        assert torch.equal(arena[:share * tp], host_full[:share * tp])
    slowest = {k: [] for k in times}
    for k, v in times.items():
        for x in v:
            box = torch.tensor([x])
            dist.all_reduce(box, op=dist.ReduceOp.MAX)
            slowest[k].append(box.item())
    if rank == 0:
        out.put(slowest)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of GLM-5 latent pages restored")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", type=Path, default=Path("bench/results/mla_host_kv.json"))
    args = ap.parse_args(argv)
    if args.tp < 2 or args.tokens < 1 or args.runs < 1:
        ap.error("--tp must be at least 2, --tokens and --runs at least 1")
    log, load = ProgressLog(), os.getloadavg()[0]
    nbytes = args.tokens * GLM5_TOKEN_BYTES
    log(f"restoring {nbytes / 2**20:.0f} MiB a rank at tp {args.tp}, {args.runs} runs")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=rank_main, args=(r, args.tp, nbytes, args.runs, port, out)) for r in range(args.tp)]
    for p in procs:
        p.start()
    slowest = out.get()
    for p in procs:
        p.join()
    median = {k: statistics.median(v) for k, v in slowest.items()}
    host = {"own_copy": args.tp * nbytes, "share_and_gather": nbytes}
    rows = [("form", "restore s (median)", "GB/s a rank", "host bytes, node")]
    rows += [(k, f"{median[k]:.3f}", f"{nbytes / median[k] / 1e9:.2f}", f"{host[k] / 2**20:.0f} MiB") for k in median]
    print(render(rows))
    print(f"({args.tokens} tokens of GLM-5 latent pages, {nbytes / 2**20:.0f} MiB a rank, tp {args.tp}, gloo on "
          f"CPU; share_and_gather / own_copy = {median['share_and_gather'] / median['own_copy']:.2f})")
    write_json(args.json, {"tp": args.tp, "tokens": args.tokens, "bytes_per_rank": nbytes, "runs": slowest,
                           "median_s": median, "host_bytes": host, **environment(log, load)}, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
