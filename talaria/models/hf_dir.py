"""Writing a plain Hugging Face model directory: the one on-disk format the engine loads.

Converted GGUF files and synthetic models both end up as ``config.json`` + ``model.safetensors`` +
``tokenizer.json`` + ``tokenizer_config.json``, so transformers can load them too (the tests do).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from talaria.contracts.arch import ModelArch

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"


def write_hf_dir(
    directory: Path,
    arch: ModelArch,
    tensors: Mapping[str, np.ndarray],
    tokenizer: Tokenizer,
    tokenizer_config: Mapping[str, Any],
) -> None:
    """Write the four files into an existing, empty ``directory``; tensors keep their dtype."""
    (directory / CONFIG).write_text(json.dumps(arch.to_hf_config(), indent=2) + "\n")
    contiguous = {name: np.ascontiguousarray(t) for name, t in tensors.items()}
    save_file(contiguous, str(directory / WEIGHTS), metadata={"format": "pt"})
    tokenizer.save(str(directory / TOKENIZER))
    (directory / TOKENIZER_CONFIG).write_text(json.dumps(dict(tokenizer_config), indent=2, ensure_ascii=False) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; OSError / ValueError propagate for the caller to explain."""
    value = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(value, dict):
        raise ValueError(f"{path.name} holds a {type(value).__name__}, not a JSON object")  # noqa: TRY004
    return value
