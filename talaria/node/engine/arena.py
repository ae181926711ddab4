"""One managed memory region per rank, handed out as typed tensor views.

Weights and KV are carved from the low end, runtime buffers from the high end; what is left in
between is what the KV pool may take. The model code only ever asks the arena for tensors, so the
memory substrate can change the allocation policy (bump layout, staging, switching) without
touching the model.
"""

from __future__ import annotations

import torch

ALIGN = 256  # bytes; keeps every view aligned for any dtype and for vector loads


class ArenaFull(MemoryError):
    pass


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    def __init__(self, nbytes: int, device: torch.device | str = "cpu", *, pin: bool = False) -> None:
        """pin: page-locked host memory (host images of device regions, for async copies)."""
        self.nbytes = nbytes
        self.device = torch.device(device)
        self._storage = torch.empty(nbytes, dtype=torch.uint8, device=self.device, pin_memory=pin)
        if self.device.type == "cpu":
            self._storage.zero_()  # touch every page now: no first-touch faults while serving
        self._low = 0  # next free byte from the bottom
        self._high = nbytes  # first byte taken from the top

    @property
    def free_bytes(self) -> int:
        return self._high - self._low

    @property
    def used_low(self) -> int:
        return self._low

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype, *, what: str = "tensor") -> torch.Tensor:
        """A view from the low end (weights, KV pool)."""
        n = align_up(_nbytes(shape, dtype))
        if self._low + n > self._high:
            raise ArenaFull(f"arena: {what} needs {n} bytes, {self.free_bytes} free of {self.nbytes}")
        view = self._view(self._low, shape, dtype)
        self._low += n
        return view

    def alloc_high(self, shape: tuple[int, ...], dtype: torch.dtype, *, what: str = "buffer") -> torch.Tensor:
        """A view anchored at the high end (runtime buffers)."""
        n = align_up(_nbytes(shape, dtype))
        if self._high - n < self._low:
            raise ArenaFull(f"arena: {what} needs {n} bytes, {self.free_bytes} free of {self.nbytes}")
        self._high -= n
        return self._view(self._high, shape, dtype)

    def release_low(self, offset: int) -> None:
        """Give back everything from `offset` up to the low watermark (a switch releases KV and weights)."""
        self._low = align_up(offset)

    def offset_of(self, t: torch.Tensor) -> int:
        """Byte offset of a view of this arena from the arena's start."""
        return t.data_ptr() - self._storage.data_ptr()

    @property
    def base(self) -> int:
        return self._storage.data_ptr()

    def bytes(self, start: int, end: int) -> torch.Tensor:
        """A raw uint8 view of [start, end)."""
        return self._storage[start:end]

    def view_at(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A typed view at a fixed offset (rebinding a model's parameters after a switch)."""
        return self._view(offset, shape, dtype)

    def _view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = _nbytes(shape, dtype)
        return self._storage[offset:offset + n].view(dtype).view(shape)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = torch.tensor([], dtype=dtype).element_size()
    for d in shape:
        n *= d
    return n
