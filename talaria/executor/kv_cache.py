"""The paged KV pool of one model on one rank: a view into the arena, page-major.

Each page is one contiguous run of bytes holding K and V of `page_size` tokens for every layer,
(layers, K|V, page_size, kv_heads, head_dim), so a page moves to and from host memory, or gives way
to a staged weight chunk, as one byte range. One extra page at the end is the null page: all
zeros, never allocated, the target of attention padding.
"""

from __future__ import annotations

import torch

from talaria.executor.parallel import Shard


class KVCache:
    def __init__(self, data: torch.Tensor, page_size: int) -> None:
        """data: (num_pages + 1, layers, 2, page_size, kv_heads, head_dim), the last page null."""
        self.data = data
        self.page_size = page_size
        self.num_pages = data.shape[0] - 1
        self.null_page = self.num_pages
        data[self.null_page].zero_()

    @staticmethod
    def page_shape(shard: Shard, page_size: int) -> tuple[int, ...]:
        return (shard.arch.num_layers, 2, page_size, shard.kv_heads, shard.arch.head_dim)

    @staticmethod
    def page_bytes(shard: Shard, page_size: int, dtype: torch.dtype) -> int:
        n = torch.tensor([], dtype=dtype).element_size()
        for d in KVCache.page_shape(shard, page_size):
            n *= d
        return n

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer i: (num_pages + 1, page_size, kv_heads, head_dim) strided views."""
        return self.data[:, i, 0], self.data[:, i, 1]
