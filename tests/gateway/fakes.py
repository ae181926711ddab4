"""Test-only stand-ins for the supervisor, for the gateway's protocol and HTTP-shape tests.

`FakeEchoSupervisor` serves one model, "echo", from engine groups that echo the prompt's bytes back
as tokens — deterministic output through the real `Tokenizer` over the synthetic models' byte
vocabulary (one token per byte, plus bos/eos/pad). Groups can be told to fail, hang or stop
early, and they record how each call ended so tests can check that the gateway closed the stream.
Nothing here runs a model; the real-engine end-to-end tests live elsewhere.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel

from talaria.config.schema import (
    InstanceConfig,
    ModelConfig,
    Pool,
    RouterConfig,
    RouterPolicy,
    ServerConfig,
    TalariaConfig,
)
from talaria.contracts.arch import ModelArch
from talaria.contracts.call import (
    CallOutput,
    FinishReason,
    InstanceCall,
    InstanceReady,
    InstanceStats,
    Usage,
)
from talaria.models.chat_template import ChatTemplate
from talaria.models.synthetic import (
    BOS,
    BOS_ID,
    CHAT_TEMPLATE,
    EOS,
    EOS_ID,
    MIN_VOCAB,
    PAD,
)
from talaria.models.synthetic import byte_tokenizer as synthetic_byte_tokenizer
from talaria.models.tokenizer import Tokenizer
from talaria.node.errors import InstanceFailed, InstanceUnavailable
from talaria.node.event_log import EventLog

MODEL = "echo"
# The synthetic models' template, plus a guard so tests can provoke a template error.
TEMPLATE = ("{% if messages[-1]['role'] == 'assistant' %}"
            "{{ raise_exception('this template cannot continue an assistant message') }}{% endif %}" + CHAT_TEMPLATE)


def byte_tokenizer() -> Tokenizer:
    """The real Tokenizer over the synthetic models' byte vocabulary: one token per UTF-8 byte."""
    backend, _config = synthetic_byte_tokenizer(MIN_VOCAB)
    special = {"bos_token": BOS, "eos_token": EOS, "unk_token": None, "pad_token": PAD}
    return Tokenizer(backend, add_bos_token=False, bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,),
                     chat_template=ChatTemplate(TEMPLATE, special))


@dataclass
class FakeEchoGroup:
    """Echoes the prompt's byte tokens cyclically until max_tokens (finish "length").

    Knobs: `fail_after` raises InstanceFailed after that many tokens; `hang_after` blocks forever
    after that many tokens (setting `hanging`); `eos_after` ends with the EOS token (finish "stop");
    `script` answers with that text (as byte tokens) and then EOS.
    Records: `calls` submitted, `closed` (generator finally ran) and `completed` (final record sent).
    """

    name: str
    healthy: bool = True
    in_flight: int = 0
    stats: InstanceStats | None = None  # the InstanceHandle attributes the router reads
    ready: InstanceReady | None = None
    restarts: int = 0
    state: str = "ready"
    last_failure: str | None = None
    fail_after: int | None = None
    hang_after: int | None = None
    eos_after: int | None = None
    cached_tokens: int = 0
    script: str | None = None  # the text to answer with (as byte tokens) instead of echoing the prompt
    hanging: anyio.Event | None = None  # create inside the test's event loop
    calls: list[InstanceCall] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)

    @property
    def config(self) -> InstanceConfig:
        return InstanceConfig(self.name, Pool.HOT, (MODEL,))

    async def switch(self, model: str, timeout: float) -> dict | None:
        raise InstanceUnavailable(f"{self.name} is a fake: it serves {MODEL!r} only and never switches")

    async def generate(self, call: InstanceCall) -> AsyncIterator[CallOutput]:
        self.calls.append(call)
        self.in_flight += 1
        source = [t for t in call.prompt_token_ids if t < 256] or [ord("x")]
        n, eos_after = call.sampling.max_tokens, self.eos_after
        if self.script is not None:  # say this, then end the turn
            source = list(self.script.encode())
            n, eos_after = min(n, len(source) + 1), len(source)
        usage = Usage(len(call.prompt_token_ids), n, self.cached_tokens)
        try:
            for i in range(n):
                if i == self.fail_after:
                    raise InstanceFailed(f"{self.name} died")
                if i == self.hang_after:
                    if self.hanging is not None:
                        self.hanging.set()
                    await anyio.sleep_forever()
                if i == eos_after:
                    usage = Usage(len(call.prompt_token_ids), i + 1, self.cached_tokens)
                    self.completed.append(call.request_id)
                    yield CallOutput(call.request_id, (EOS_ID,), FinishReason.STOP, usage)
                    return
                token = (source[i % len(source)],)
                if i == n - 1:
                    self.completed.append(call.request_id)
                    yield CallOutput(call.request_id, token, FinishReason.LENGTH, usage)
                    return
                yield CallOutput(call.request_id, token)
                await anyio.lowlevel.checkpoint()  # let the consumer and the disconnect watcher run
        finally:
            self.in_flight -= 1
            self.closed.append(call.request_id)


def fake_arch(max_position: int = 128) -> ModelArch:
    return ModelArch(vocab_size=MIN_VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_position=max_position, eos_token_ids=(EOS_ID,))


class FakeEchoSupervisor:
    """A NodeHandle over in-process FakeEchoGroups (no engine processes), with a real event log."""

    def __init__(self, groups: list[FakeEchoGroup] | None = None, *, api_key: str | None = None,
                 max_body_bytes: int = 1 << 20, router: RouterConfig | None = None,
                 max_position: int = 128, server: ServerConfig | None = None) -> None:
        self.groups = groups if groups is not None else [FakeEchoGroup("hot0")]
        self.config = TalariaConfig(
            path=None,
            server=server or ServerConfig(api_key=api_key, max_body_bytes=max_body_bytes),
            models=(ModelConfig(MODEL, "synthetic:"),),
            instances=tuple(g.config for g in self.groups),
            router=router or RouterConfig(policy=RouterPolicy.LEAST_PRESSURE),  # fakes carry no cost profile
        )
        self.events = EventLog()
        self._tokenizer = byte_tokenizer()
        self._arch = fake_arch(max_position)
        self.instance_stats = [InstanceStats(g.name, waiting=1, running=2, kv_pages_used=3, kv_pages_total=12)
                               for g in self.groups]

    def model_names(self) -> list[str]:
        return [MODEL]

    def tokenizer(self, model: str) -> Tokenizer:
        return self._tokenizer

    def arch(self, model: str) -> ModelArch:
        return self._arch

    def groups_for(self, model: str) -> list[FakeEchoGroup]:
        return list(self.groups) if model == MODEL else []

    def stats(self) -> list[InstanceStats]:
        return list(self.instance_stats)


class TemplateCatalog:
    """One model, "echo", with the byte-level vocabulary and a given chat template: what a model's
    template does to a request (Qwen3.5's shape, one that takes one system message only, ...)."""

    def __init__(self, template: str, max_position: int = 4096) -> None:
        self._base = FakeEchoSupervisor(max_position=max_position)
        self.config = self._base.config
        backend, _ = synthetic_byte_tokenizer(MIN_VOCAB)
        special = {"bos_token": BOS, "eos_token": EOS, "unk_token": None, "pad_token": PAD}
        self.tok = Tokenizer(backend, add_bos_token=False, bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,),
                             chat_template=ChatTemplate(template, special))

    def model_names(self) -> list[str]:
        return [MODEL]

    def tokenizer(self, model: str) -> Tokenizer:
        return self.tok

    def arch(self, model: str) -> ModelArch:
        return self._base.arch(model)


@contextmanager
def serve_over_loopback(group: FakeEchoGroup, api_key: str | None = None) -> Iterator[str]:
    """The real gateway over `group`, served on loopback (`serve_app`); its URL."""
    from talaria.gateway.gateway import create_app

    with serve_app(create_app(FakeEchoSupervisor([group], api_key=api_key, max_position=4096))) as url:
        yield url


@contextmanager
def serve_app(app) -> Iterator[str]:
    """An ASGI app under uvicorn in a thread, on a socket bound before the thread starts (the kernel
    queues connections until uvicorn accepts them: no start-up wait); its URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
