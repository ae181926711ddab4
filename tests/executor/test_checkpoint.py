"""Checkpoints by shard: at TP 2, each rank of a sharded safetensors checkpoint (several files and
model.safetensors.index.json, 272 MiB per rank) reads its slices and no more — counted by the
loader and bounded by the rank's shard plus its replicated tensors — and its anonymous memory
grows by its arena alone: no whole tensor is materialised, not the vocabulary, not the experts,
whether they are stored one tensor per expert or fused."""

from __future__ import annotations

import json
import multiprocessing
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from talaria.contracts.arch import ModelArch
from talaria.executor.arena import Arena
from talaria.executor.parallel import Shard
from talaria.executor.weights import load_weights, weights_nbytes

TP = 2
MIB = 1 << 20
# qwen3_moe, 6 layers: 0, 2, 4 dense; 1 and 5 with one tensor per expert, 3 with fused experts
ARCH = ModelArch(vocab_size=32768, hidden_size=1024, intermediate_size=2048, num_layers=6, num_heads=8,
                 num_kv_heads=4, head_dim=128, max_position=4096, qk_norm=True, family="qwen3_moe",
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, decoder_sparse_step=2)
FUSED_LAYERS = (3,)


def checkpoint_tensors(arch: ModelArch) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor, in file order."""
    h, hd, e, m = arch.hidden_size, arch.head_dim, arch.num_experts, arch.moe_intermediate_size
    out = [("model.embed_tokens.weight", (arch.vocab_size, h))]
    for i in range(arch.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        out += [(p + "input_layernorm.weight", (h,)), (a + "q_proj.weight", (arch.q_size, h)),
                (a + "k_proj.weight", (arch.kv_size, h)), (a + "v_proj.weight", (arch.kv_size, h)),
                (a + "q_norm.weight", (hd,)), (a + "k_norm.weight", (hd,)), (a + "o_proj.weight", (h, arch.q_size)),
                (p + "post_attention_layernorm.weight", (h,))]
        mlp = p + "mlp."
        if not arch.is_moe_layer(i):
            out += [(mlp + "gate_proj.weight", (arch.intermediate_size, h)),
                    (mlp + "up_proj.weight", (arch.intermediate_size, h)),
                    (mlp + "down_proj.weight", (h, arch.intermediate_size))]
        elif i in FUSED_LAYERS:
            out += [(mlp + "gate.weight", (e, h)), (mlp + "experts.gate_up_proj", (e, 2 * m, h)),
                    (mlp + "experts.down_proj", (e, h, m))]
        else:
            out += [(mlp + "gate.weight", (e, h))]
            out += [(f"{mlp}experts.{x}.{n}.weight", s) for x in range(e)
                    for n, s in (("gate_proj", (m, h)), ("up_proj", (m, h)), ("down_proj", (h, m)))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (arch.vocab_size, h))]


def replicated(name: str, shape: tuple[int, ...]) -> bool:
    """Tensors every rank holds whole: norms and routers (KV heads split: 4 over tp 2)."""
    return len(shape) == 1 or name.endswith("mlp.gate.weight")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """The checkpoint in files of about 150 MiB each, float32, from a fixed seed."""
    directory = tmp_path_factory.mktemp("sharded")
    gen = torch.Generator().manual_seed(0)
    weight_map, part, size, files = {}, {}, 0, []

    def flush():
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(part, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
        files.append(name)
    for name, shape in checkpoint_tensors(ARCH):
        part[name] = torch.randn(shape, generator=gen)
        size += part[name].nbytes
        if size > 150 * MIB:
            flush()
            part, size = {}, 0
    if part:
        flush()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert len(files) >= 3
    return directory


def rss_anon() -> int:
    """Anonymous resident bytes of this process (heap, arenas; not mapped files)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def load_rank(directory: Path, rank: int) -> dict:
    """One rank's load, in its own process: bytes read, anonymous memory (after and at its peak,
    sampled every 2 ms), progress calls, and spot checks of the values against safetensors."""
    torch.set_num_threads(1)
    shard = Shard(rank, TP, ARCH)
    need = weights_nbytes(shard, torch.float32)
    base = peak = rss_anon()
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.wait(0.002):
            peak = max(peak, rss_anon())
    sampler = threading.Thread(target=sample)
    sampler.start()
    calls = []
    try:
        weights = load_weights(directory, shard, Arena(need, "cpu"), torch.float32,
                               progress=lambda d, t: calls.append((d, t)))
    finally:
        done.set()
        sampler.join()
    after = rss_anon()
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]

    def stored(name: str):
        return safe_open(directory / index[name], framework="pt").get_slice(name)
    full, v = ARCH.moe_intermediate_size, ARCH.vocab_size // TP
    m = full // TP
    fused, split = weights.layers[3], weights.layers[1]
    checks = {
        "lm_head rows": torch.equal(weights.lm_head, stored("lm_head.weight")[rank * v:(rank + 1) * v]),
        "fused up rows": torch.equal(fused.experts_gate_up[5, m:],
                                     stored("model.layers.3.mlp.experts.gate_up_proj")[5, full + rank * m:full + (rank + 1) * m]),
        "fused down columns": torch.equal(fused.experts_down,
                                          stored("model.layers.3.mlp.experts.down_proj")[:, :, rank * m:(rank + 1) * m]),
        "expert down columns": torch.equal(split.experts_down[7],
                                           stored("model.layers.1.mlp.experts.7.down_proj.weight")[:, rank * m:(rank + 1) * m]),
        "router": torch.equal(split.router, stored("model.layers.1.mlp.gate.weight")[:]),
    }
    return {"shard": need, "bytes_read": weights.bytes_read, "rise": after - base, "peak_rise": peak - base,
            "progress": calls, "checks": checks}


def test_each_rank_reads_only_its_slices_into_its_arena(sharded):
    with multiprocessing.get_context("spawn").Pool(TP) as pool:
        ranks = pool.starmap(load_rank, [(sharded, r) for r in range(TP)])
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    own = 0  # what a rank must read: a tp-th of every split tensor, replicated ones whole (float32)
    for name, shape in checkpoint_tensors(ARCH):
        with safe_open(sharded / index[name], framework="pt") as f:
            assert tuple(f.get_slice(name).get_shape()) == shape
        n = 4
        for d in shape:
            n *= d
        own += n if replicated(name, shape) else n // TP
    for rank, r in enumerate(ranks):
        assert r["shard"] >= 256 * MIB, "the test wants at least 256 MiB per rank"
        assert own <= r["bytes_read"] <= 1.05 * own, (rank, r["bytes_read"], own)
        assert r["rise"] <= 1.3 * r["shard"] and r["peak_rise"] <= 1.3 * r["shard"], (rank, r)
        assert all(r["checks"].values()), (rank, r["checks"])
        done = [d for d, _ in r["progress"]]
        assert done == sorted(done) and r["progress"][-1] == (r["bytes_read"], r["bytes_read"])
        assert len(r["progress"]) > 100  # progress moves tensor by tensor, not once at the end


def test_progress_lines_are_rate_limited_and_end_at_the_total():
    import io

    from talaria.executor.checkpoint import print_progress
    out, now = io.StringIO(), [0.0]
    show = print_progress("talaria: cold0: loading m", out, every_s=1.0, clock=lambda: now[0])
    for done, t in ((0, 0.0), (10 * MIB, 0.5), (20 * MIB, 1.2), (30 * MIB, 1.3), (40 * MIB, 1.4)):
        now[0] = t
        show(done, 40 * MIB)
    assert out.getvalue().splitlines() == ["talaria: cold0: loading m: 0/40 MiB (0%)",
                                           "talaria: cold0: loading m: 20/40 MiB (50%)",
                                           "talaria: cold0: loading m: 40/40 MiB (100%)"]
