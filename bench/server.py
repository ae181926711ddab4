"""A `talaria up` subprocess for benchmarks, started and stopped as tests/conftest.py does."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

START_TIMEOUT_S = 300  # a first start generates the synthetic weights into ~/.cache/talaria


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(config: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "talaria.cli.main", "up", "--config", str(config),
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, base_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"talaria up exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"talaria up not healthy after {START_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- one run ---------------------------------------------------------------------------------
