"""One managed memory region, handed out as typed tensor views.

On the device it is a rank's arena: the bump layout (talaria/memory/bump_layout.py) says which
byte ranges hold the active model's weights, its KV pool and the runtime state, and the substrate
binds views there with `view_at`. On the host it holds a model's weight image, filled in load
order with `alloc`. The model code only ever sees tensors, so the layout can change without it.
"""

from __future__ import annotations

import torch

from talaria.memory.bump_layout import ALIGN


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
        self._low = 0  # next free byte: `alloc` bumps upward (host weight images)

    @property
    def free_bytes(self) -> int:
        return self.nbytes - self._low

    @property
    def used_low(self) -> int:
        return self._low

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype, *, what: str = "tensor") -> torch.Tensor:
        """The next view from the low end (a model's weights, in load order)."""
        n = align_up(_nbytes(shape, dtype))
        if self._low + n > self.nbytes:
            raise ArenaFull(f"arena: {what} needs {n} bytes, {self.free_bytes} free of {self.nbytes}")
        view = self._view(self._low, shape, dtype)
        self._low += n
        return view

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
