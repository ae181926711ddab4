"""Runs StepPlans for one model on one rank: owns the model's weights and KV pool views."""

from __future__ import annotations

import torch

from talaria.models.source import ModelFiles
from talaria.node.engine.arena import Arena
from talaria.node.engine.attention import AttentionMeta
from talaria.node.engine.kv_cache import KVCache
from talaria.node.engine.llama import LlamaModel
from talaria.node.engine.parallel import Shard, TPGroup
from talaria.node.engine.weights import load_weights
from talaria.node.step_plan import StepPlan

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(self, files: ModelFiles, arena: Arena, group: TPGroup) -> None:
        self.files = files
        self.dtype = DTYPES[files.dtype]
        self.shard = Shard(group.rank, group.size, files.arch)
        self.group = group
        self.device = arena.device
        weights = load_weights(files.directory, self.shard, arena, self.dtype)
        self.model = LlamaModel(files.arch, self.shard, weights, group, self.dtype)
        self.kv: KVCache | None = None

    def page_bytes(self, page_size: int) -> int:
        return KVCache.page_bytes(self.shard, page_size, self.dtype)

    def bind_kv(self, arena: Arena, num_pages: int, page_size: int) -> None:
        shape = (num_pages + 1, *KVCache.page_shape(self.shard, page_size))  # + the null page
        self.kv = KVCache(arena.alloc(shape, self.dtype, what="KV pool"), page_size)

    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Run one step; logits (S, V) for the chunks that sample, in plan order, on rank 0."""
        ids, pos, sample_rows = [], [], []
        for c in plan.chunks:
            ids.extend(c.token_ids)
            pos.extend(range(c.start_pos, c.context_len))
            if c.sample:
                sample_rows.append(len(ids) - 1)
        dev = self.device
        meta = AttentionMeta.build(plan, self.kv.page_size, self.kv.null_page, dev)
        hidden = self.model.forward(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta, self.kv)
        if not sample_rows:
            return None
        return self.model.logits(hidden[torch.tensor(sample_rows, device=dev)])
