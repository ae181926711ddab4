"""Shared fixtures: one real `talaria up` process per test session, on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "talaria.toml"
START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    log_path: Path

    @property
    def api(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"talaria up exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"talaria up not healthy after {timeout}s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(config: Path, log_path: Path, *extra: str) -> Server:
    port = free_port()
    log = log_path.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "talaria.cli.main", "up", "--config", str(config),
                             "--port", str(port), *extra],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return Server(proc, f"http://127.0.0.1:{port}", log_path)


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    """The default config (SmolLM2 on a hot instance, two synthetic models on a TP=2 cold one)."""
    srv = start_server(DEFAULT_CONFIG, tmp_path_factory.mktemp("server") / "talaria.log")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()
