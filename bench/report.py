"""What every benchmark prints and records about itself: the machine, its table, and its verdict."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path


class ProgressLog:
    """Progress lines on stderr, stamped with the seconds since the benchmark started."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, msg: str) -> None:
        print(f"[{self.elapsed:7.1f}s] {msg}", file=sys.stderr, flush=True)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(log: ProgressLog, load_start: float) -> dict:
    """What a result depends on besides the code: software, machine, load, date, duration."""
    import os

    import torch

    return {
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": {"start": load_start, "end": os.getloadavg()[0]},
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "wall_s": log.elapsed,
    }


def render(rows: list[tuple[str, ...]]) -> str:
    """A text table: the first row is the header, the first column left-aligned, the rest right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: Path, result: dict, log: ProgressLog) -> None:
    """The benchmark's whole result as indented JSON (non-JSON values as their str)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    log(f"wrote {path}")


def add_gate_flag(ap: argparse.ArgumentParser) -> None:
    """The `--no-gate` flag of a benchmark with targets (see `gate`)."""
    ap.add_argument("--no-gate", action="store_true",
                    help="exit 0 when a target is missed, to explore; a wrong result still exits 1")


def gate(missed: list[str], wrong: list[str], no_gate: bool) -> int:
    """A benchmark's exit status, its verdict printed on stdout: 1 when a target was missed (unless
    --no-gate: exploring) or when a result was wrong (a greedy disagreement with the reference, a
    failed call: a wrong result is never a matter of speed, so --no-gate does not excuse it)."""
    for what in wrong:
        print(f"FAILED: {what}")
    if missed:
        print(f"targets missed: {'; '.join(missed)}" + (" (--no-gate: not failing for them)" if no_gate else ""))
    else:
        print("all targets met")
    return 1 if wrong or (missed and not no_gate) else 0
