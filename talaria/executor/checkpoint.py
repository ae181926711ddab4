"""Reading one rank's slices of a safetensors checkpoint straight into the arena, and counting them.

A rank holds 1/tp of most tensors, so it must not read whole tensors and slice them afterwards:
that would read tp times its share and, through a temporary tensor, hold a whole tensor in memory
beside the arena. Each file is memory-mapped; a slice is a strided view of the mapping, copied by
one `copy_` into its arena view (converting the dtype on the way). Only the slice's bytes are
touched, no anonymous memory is allocated beyond the arena, and the reader counts the bytes it
copies out of the files (`bytes_read`), which tests and load progress read.

Reads are queued while the loader allocates the arena views (`read_into`), then run file by file
in offset order (`run`): the files are read front to back, and the total is known before the
first byte, so progress can say how far along it is.

The safetensors layout (https://github.com/huggingface/safetensors): an 8-byte little-endian
header length, a JSON header mapping each name to its dtype, shape and [begin, end) byte offsets
into the data that follows.
"""

from __future__ import annotations

import json
import mmap
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8}  # the last two: quantized weights and scales

Progress = Callable[[int, int], None]  # (bytes read so far, bytes this rank will read)


class CheckpointError(ValueError):
    """A checkpoint the loader cannot read; the message names the file and the tensor."""


@dataclass(frozen=True, slots=True)
class _Entry:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file


@dataclass(frozen=True, slots=True)
class _Read:
    out: torch.Tensor  # the arena view to fill
    entry: _Entry
    dim: int | None  # None: the whole tensor
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.out.numel() * self.entry.dtype.itemsize


class ShardReader:
    """The tensors of one checkpoint directory (a single file, or shards listed in an index)."""

    def __init__(self, directory: Path) -> None:
        index = directory / INDEX
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [SINGLE]
        self._entries: dict[str, _Entry] = {}
        for name in files:
            self._entries |= _header(directory / name)
        self._queue: list[_Read] = []
        self.bytes_read = 0  # bytes copied out of the files so far

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape tensor `name` has in the checkpoint."""
        if name not in self._entries:
            raise CheckpointError(f"the checkpoint has no tensor {name!r}; is it a checkpoint of this model?")
        return self._entries[name].shape

    @property
    def planned_bytes(self) -> int:
        """Bytes the queued reads will copy out of the files."""
        return sum(r.nbytes for r in self._queue)

    def read_into(self, out: torch.Tensor, name: str, dim: int | None = None, start: int = 0,
                  stop: int | None = None) -> None:
        """Queue a copy of tensor `name`, or its [start, stop) along `dim`, into `out`."""
        entry = self._entries.get(name)
        if entry is None:
            raise CheckpointError(f"the checkpoint has no tensor {name!r}; is it a checkpoint of this model?")
        shape = list(entry.shape)
        if dim is not None:
            stop = shape[dim] if stop is None else stop
            shape[dim] = stop - start
        if tuple(shape) != tuple(out.shape) or (dim is not None and not 0 <= start <= stop <= entry.shape[dim]):
            raise CheckpointError(f"{entry.path.name}: {name} has shape {list(entry.shape)}; the model's config "
                                  f"needs {list(out.shape)} from it (dim {dim}, [{start}, {stop})): "
                                  "config.json and the weights disagree")
        self._queue.append(_Read(out, entry, dim, start, stop or 0))

    def run(self, progress: Progress | None = None) -> int:
        """Do the queued reads, file by file in offset order; the bytes read."""
        total = self.planned_bytes
        if progress is not None:
            progress(self.bytes_read, total)
        queue, self._queue = sorted(self._queue, key=lambda r: (str(r.entry.path), r.entry.offset)), []
        for path in dict.fromkeys(r.entry.path for r in queue):
            with open(path, "rb") as f:
                # a private mapping: writable for torch.frombuffer, never written, so no page is copied
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            try:
                for r in (r for r in queue if r.entry.path == path):
                    self._copy(mapped, r)
                    if progress is not None:
                        progress(self.bytes_read, total)
            finally:
                try:
                    mapped.close()
                except BufferError:  # a view still alive somewhere: the mapping goes with it
                    pass
        return self.bytes_read

    def _copy(self, mapped: mmap.mmap, r: _Read) -> None:
        e = r.entry
        numel = 1
        for d in e.shape:
            numel *= d
        whole = torch.frombuffer(mapped, dtype=e.dtype, count=numel, offset=e.offset).view(e.shape)
        src = whole if r.dim is None else whole.narrow(r.dim, r.start, r.stop - r.start)
        r.out.copy_(src)  # touches only the slice's bytes of the mapping
        self.bytes_read += r.nbytes
        del whole, src


def _header(path: Path) -> dict[str, _Entry]:
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); re-download the model") from None
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path.name}: {name} is stored as {info['dtype']}; Talaria reads "
                                  f"{', '.join(_DTYPES)} checkpoints")
        entries[name] = _Entry(path, dtype, tuple(info["shape"]), 8 + size + info["data_offsets"][0])
    return entries


def print_progress(label: str, stream=sys.stderr, every_s: float = 1.0,
                   clock: Callable[[], float] = time.monotonic) -> Progress:
    """A `Progress` that writes `label: 120/544 MiB (22%)` lines: the first, then at most one
    every `every_s`, and the last. For worker processes, which share the command's stderr
    (`talaria up`, `talaria profile`): pass it to `load_weights` for rank 0's loads."""
    last: list[float | None] = [None]

    def show(done: int, total: int) -> None:
        now = clock()
        if done < total and last[0] is not None and now - last[0] < every_s:
            return
        last[0] = now
        stream.write(f"{label}: {done >> 20}/{total >> 20} MiB ({100 * done // max(total, 1)}%)\n")
        stream.flush()
    return show
