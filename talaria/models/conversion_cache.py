"""A folder of converted models, each written once and published by an atomic rename.

A conversion (GGUF dequantization, synthetic generation) is keyed by a fingerprint of its inputs.
The model is built in a private temporary folder and renamed into place, so a folder under the
cache root is always complete, a second open only reads ``config.json``, and two processes that
race both convert but only the first rename wins (the loser deletes its copy and uses the winner's).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV_VAR = "TALARIA_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$TALARIA_CACHE_DIR`` or ``~/.cache/talaria``, read at call time."""
    return Path(os.environ.get(ENV_VAR) or Path.home() / ".cache" / "talaria").expanduser()


def fingerprint(parts: dict[str, Any]) -> str:
    """A short stable hash of JSON-serialisable ``parts`` (sorted keys)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class ConversionCache:
    """Converted model folders under ``root``, named ``<label>-<fingerprint>``."""

    def __init__(self, root: Path):
        self.root = root

    def folder(self, label: str, key: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[:60]
        return self.root / f"{safe}-{key}"

    def ensure(self, folder: Path, build: Callable[[Path], object]) -> Path:
        """``folder``, calling ``build(tmp)`` to fill a fresh temp folder first if it does not exist."""
        if folder.is_dir():
            return folder
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=self.root))
        try:
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; a converted model is not a secret
            try:
                os.rename(tmp, folder)  # atomic; fails if another process published first
            except OSError:
                if not folder.is_dir():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return folder
