"""Bench scripts loaded as modules, for tests of their pure functions: each imports its siblings in
bench/ (report, server, ...) as a script would, so bench/ is on sys.path while it is loaded."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py as the module `bench_<name>` (registered: dataclasses resolve their module by name)."""
    if f"bench_{name}" in sys.modules:
        return sys.modules[f"bench_{name}"]
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module
