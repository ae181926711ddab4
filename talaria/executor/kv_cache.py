"""The cache of one model on one rank: typed views into the arena's page pool and state region.

Both are raw bytes laid out as the model's `KVLayout` (talaria/contracts/kv_layout.py) says: a page
is one contiguous run holding `page_size` tokens of every per-token tensor of every layer, so a page
moves to and from host memory, or gives way to a staged weight chunk, as one byte range; a state
slot is one contiguous run holding a sequence's per-sequence tensors. One extra page at the end is
the null page: all zeros, never allocated, the target of attention padding.
"""

from __future__ import annotations

import torch

from talaria.contracts.kv_layout import KVLayout

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "uint8": torch.uint8}


class KVCache:
    def __init__(self, pages: torch.Tensor, layout: KVLayout, states: torch.Tensor | None = None) -> None:
        """pages: uint8 (num_pages + 1, page_bytes), the last page null; states: uint8
        (num_state_slots, state_bytes), or None when the layout keeps no per-sequence state."""
        self.pages = pages
        self.states = states
        self.layout = layout
        self.page_size = layout.page_size
        self.num_pages = pages.shape[0] - 1
        self.null_page = self.num_pages
        pages[self.null_page].zero_()
        # the views, made once: a forward asks for every layer's at every step
        self._views = {(t.name, i): self._view(t, i) for t in layout.tensors for i in t.layers
                       if t.per_token or states is not None}

    def _view(self, t, layer: int) -> torch.Tensor:
        at = self.layout.offsets[(t.name, layer)]
        rows, per = (self.pages, self.page_size) if t.per_token else (self.states, 1)
        typed = rows[:, at:at + t.nbytes * per].view(TORCH_DTYPES[t.dtype])  # last dim contiguous
        return typed.view(rows.shape[0], *((per,) if t.per_token else ()), *t.shape)

    def view(self, name: str, layer: int) -> torch.Tensor:
        """Tensor `name` of `layer`: (num_pages + 1, page_size, *shape) per token, or
        (num_state_slots, *shape) per sequence; a strided view of the bytes, no copy."""
        return self._views[(name, layer)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer i: (num_pages + 1, page_size, kv_heads, head_dim) strided views."""
        return self.view("k", i), self.view("v", i)
