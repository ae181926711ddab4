"""A GGUF file's metadata and tensor table, read without touching tensor data until asked.

Why not ``gguf.GGUFReader``: it builds a numpy view for every element of every metadata array, so
opening SmolLM2 (49k tokens, 49k merges) takes over 4 s on a laptop core, and ``model_arch`` has to
be instant. This reader walks the header with ``struct`` (about 20 ms without the vocabulary), and
still leaves the dequantization to ``gguf.quants`` and the type table to ``gguf.constants``.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Container
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# fixed-size metadata value types -> struct format (8 is string, 9 is array)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GgufFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (truncated, wrong magic, new version)."""


@dataclass(frozen=True, slots=True)
class GgufTensorInfo:
    name: str  # llama.cpp's name, e.g. "blk.0.attn_q.weight"
    shape: tuple[int, ...]  # row-major (numpy/torch) order, i.e. ggml's dims reversed
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file

    @property
    def nbytes(self) -> int:
        block, block_bytes = GGML_QUANT_SIZES[self.ggml_type]
        return prod(self.shape) // block * block_bytes


class GgufFile:
    """Metadata (``metadata``), array lengths (``lengths``) and tensor table (``tensors``) of a file.

    String arrays are skipped unless named in ``string_arrays`` (their length is still in
    ``lengths``), so reading the architecture does not pay for the vocabulary.
    """

    def __init__(self, path: Path, metadata: dict[str, Any], lengths: dict[str, int],
                 tensors: dict[str, GgufTensorInfo]):
        self.path = path
        self.metadata = metadata
        self.lengths = lengths
        self.tensors = tensors
        self._blob: np.memmap | None = None

    @classmethod
    def open(cls, path: Path, string_arrays: Container[str] = ()) -> GgufFile:
        """Parse the header. Raises OSError if unreadable, GgufFormatError if not a valid GGUF."""
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
                return cls(path, *_parse(blob, string_arrays))
        except GgufFormatError as e:
            raise GgufFormatError(f"{path}: {e}") from None
        except (struct.error, UnicodeDecodeError, KeyError, ValueError) as e:  # ValueError: empty file
            raise GgufFormatError(f"{path}: corrupt or truncated GGUF header ({type(e).__name__}: {e})") from e

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name`` dequantized to a fresh float32 array of its row-major shape."""
        info = self.tensors[name]
        if self._blob is None:
            self._blob = np.memmap(self.path, dtype=np.uint8, mode="r")
        block, block_bytes = GGML_QUANT_SIZES[info.ggml_type]
        row_bytes = info.shape[-1] // block * block_bytes
        raw = self._blob[info.offset: info.offset + info.nbytes]
        if raw.size != info.nbytes:
            raise GgufFormatError(f"{self.path}: tensor {name} runs past the end of the file (truncated download?)")
        rows = raw.reshape(*info.shape[:-1], row_bytes)
        try:
            values = dequantize(rows, info.ggml_type)
        except NotImplementedError as e:
            raise GgufFormatError(f"{self.path}: tensor {name} is {info.ggml_type.name}, which gguf cannot dequantize") from e
        out = np.asarray(values, dtype=np.float32).reshape(info.shape)
        # F32 tensors come back as views of the read-only map; the caller gets its own array
        return out.copy() if np.may_share_memory(out, self._blob) else out


def _parse(blob: mmap.mmap, string_arrays: Container[str]):
    if blob[:4] != _MAGIC:
        raise GgufFormatError("the file does not start with the GGUF magic bytes")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in _VERSIONS:
        raise GgufFormatError(f"GGUF version {version} is not supported (only {_VERSIONS})")
    pos = 24
    metadata: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for _ in range(kv_count):
        key, pos = _string(blob, pos)
        (kind,) = struct.unpack_from("<I", blob, pos)
        pos += 4
        if kind == _ARRAY:
            (item_kind, count) = struct.unpack_from("<IQ", blob, pos)
            pos += 12
            lengths[key] = count
            value, pos = _array(blob, pos, item_kind, count, key in string_arrays)
            if value is not None:
                metadata[key] = value
        else:
            metadata[key], pos = _value(blob, pos, kind)
    if "general.architecture" not in metadata:
        raise GgufFormatError("the metadata has no general.architecture")

    table = []
    for _ in range(tensor_count):
        name, pos = _string(blob, pos)
        (ndim,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{ndim}Q", blob, pos + 4)
        pos += 4 + 8 * ndim
        kind, offset = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        table.append((name, tuple(reversed(dims)), GGMLQuantizationType(kind), offset))
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors = {name: GgufTensorInfo(name, shape, kind, data_start + offset) for name, shape, kind, offset in table}
    return metadata, lengths, tensors


def _string(blob: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    pos += 8
    return blob[pos: pos + length].decode("utf-8"), pos + length


def _value(blob: mmap.mmap, pos: int, kind: int) -> tuple[Any, int]:
    if kind == _STRING:
        return _string(blob, pos)
    if kind not in _SCALAR:
        raise GgufFormatError(f"unknown metadata value type {kind}")
    fmt = "<" + _SCALAR[kind]
    return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)


def _array(blob: mmap.mmap, pos: int, kind: int, count: int, keep: bool) -> tuple[list | None, int]:
    if kind in _SCALAR:
        fmt = f"<{count}{_SCALAR[kind]}"
        return list(struct.unpack_from(fmt, blob, pos)), pos + struct.calcsize(fmt)
    if kind != _STRING:
        raise GgufFormatError(f"metadata arrays of type {kind} are not supported")
    values: list[str] | None = [] if keep else None
    for _ in range(count):
        if values is not None:
            value, pos = _string(blob, pos)
            values.append(value)
        else:  # variable length: walk it without decoding
            (length,) = struct.unpack_from("<Q", blob, pos)
            pos += 8 + length
    return values, pos
