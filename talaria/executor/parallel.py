"""Tensor parallelism over torch.distributed: which shard a rank holds, and the collectives.

Column-parallel linears split output features (q/k/v heads, gate/up rows); row-parallel linears
split input features and all-reduce their outputs (o_proj, down_proj); the embedding and the LM
head split the vocabulary. When tp exceeds the KV heads, KV heads are replicated (as vLLM and
SGLang do): rank r keeps the one KV head its query heads attend to.

Mixture-of-Experts layers are tensor-parallel inside each expert (docs/moe.md): every rank holds
every expert's slice of the expert width and the full router, so all ranks route alike and the
layer ends in the same one all-reduce as a dense MLP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from talaria.contracts.arch import ModelArch
from talaria.contracts.kv_layout import kv_heads_per_rank


@dataclass(frozen=True, slots=True)
class Shard:
    rank: int
    size: int
    arch: ModelArch

    @property
    def heads(self) -> int:
        return self.arch.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        return kv_heads_per_rank(self.arch, self.size)

    @property
    def head_range(self) -> tuple[int, int]:
        return self.rank * self.heads, (self.rank + 1) * self.heads

    @property
    def kv_head_range(self) -> tuple[int, int]:
        if self.size <= self.arch.num_kv_heads:
            return self.rank * self.kv_heads, (self.rank + 1) * self.kv_heads
        first = self.rank * self.arch.num_kv_heads // self.size  # replicated: the head our queries use
        return first, first + 1

    @property
    def linear_key_heads(self) -> int:
        """Gated DeltaNet query/key heads per rank (their value heads, conv channels and state follow)."""
        return self.arch.linear_num_key_heads // self.size

    @property
    def linear_value_heads(self) -> int:
        return self.arch.linear_num_value_heads // self.size

    @property
    def intermediate(self) -> int:
        """Dense MLP width per rank."""
        return self.arch.intermediate_size // self.size

    @property
    def moe_intermediate(self) -> int:
        """Each routed expert's width per rank."""
        return self.arch.moe_intermediate_size // self.size

    @property
    def shared_intermediate(self) -> int:
        """The shared expert's width per rank (Qwen2-MoE; 0 without one)."""
        return self.arch.shared_expert_intermediate_size // self.size

    def width_range(self, local: int) -> tuple[int, int]:
        """This rank's columns of an MLP whose per-rank width is `local`."""
        return self.rank * local, (self.rank + 1) * local

    @property
    def vocab(self) -> int:
        """Rows of the embedding/head per rank; the last rank's tail is zero padding."""
        return -(-self.arch.vocab_size // self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        start = self.rank * self.vocab
        return start, min(start + self.vocab, self.arch.vocab_size)


class TPGroup:
    """The collectives the model needs; a group of one does no communication."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's shard along the last dim on rank 0 (None elsewhere)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def gather_objects(self, obj: object) -> list | None:
        """Every rank's `obj` as a list on rank 0 (None elsewhere)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def broadcast_object(self, obj: object = None) -> object:
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
