"""The paged KV pool of one model on one rank: a view into the arena, one slot per token."""

from __future__ import annotations

import torch

from talaria.node.engine.arena import Arena
from talaria.node.engine.parallel import Shard


class KVCache:
    def __init__(self, arena: Arena, shard: Shard, num_pages: int, page_size: int, dtype: torch.dtype) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        slots = num_pages * page_size
        # (layers, K|V, slots, kv_heads, head_dim)
        self.data = arena.alloc((shard.arch.num_layers, 2, slots, shard.kv_heads, shard.arch.head_dim),
                                dtype, what="KV pool")

    @staticmethod
    def page_bytes(shard: Shard, page_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.tensor([], dtype=dtype).element_size()
        return shard.arch.num_layers * 2 * page_size * shard.kv_heads * shard.arch.head_dim * itemsize

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, 0], self.data[i, 1]
