"""`talaria up` as a process: workers that die, signals that stop it, an API key, and the CLI help.

Each test here runs its own server on a small config of synthetic models (they start in seconds)
so that killing processes never touches the session's shared server. Tests that leave their server
serving share one; tests that end it start their own.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from click.testing import CliRunner

from talaria.cli.main import cli
from tests.conftest import Server, living, start_server, wait_for
from tests.served_models import synthetic_model_toml

pytestmark = pytest.mark.slow

API_KEY = "test-key"
HOT, COLD = "hot-0", "cold-0"  # hot-0 serves tiny-llama on one rank, cold-0 tiny-qwen3 on two
MODEL_OF = {HOT: "tiny-llama", COLD: "tiny-qwen3"}
TP = {HOT: 1, COLD: 2}  # in config order
ERROR_WITHIN_S = 10.0  # a call on a dead instance must fail this fast, never hang
RECOVER_WITHIN_S = 60.0  # the group respawns its workers: a torch import per rank on a busy CPU
STOP_WITHIN_S = 30.0
ORPHANS_GONE_WITHIN_S = 5.0

SYNTHETIC_MODELS = (synthetic_model_toml(MODEL_OF[HOT], "llama", 1, tie_word_embeddings=False)
                    + synthetic_model_toml(MODEL_OF[COLD], "qwen3", 2, tie_word_embeddings=True) + """
[[instances]]
name = "hot-0"
pool = "hot"
models = ["tiny-llama"]
tp = 1
arena_bytes = "64MiB"

[[instances]]
name = "cold-0"
pool = "cold"
models = ["tiny-qwen3"]
tp = 2
arena_bytes = "64MiB"
""")


def tiny_config(directory: Path, api_key: str | None = None) -> Path:
    server = '[server]\nhost = "127.0.0.1"\n' + (f'api_key = "{api_key}"\n' if api_key else "")
    path = directory / "talaria.toml"
    path.write_text(server + SYNTHETIC_MODELS)
    return path


def started(tmp: Path, api_key: str | None = None) -> Server:
    srv = start_server(tiny_config(tmp, api_key), tmp / "talaria.log")
    try:
        srv.wait_healthy()
    except BaseException:
        srv.stop()
        raise
    return srv


def ranks_at_startup(server: Server) -> dict[str, list[int]]:
    """Each instance's worker pids in rank order, before any group has restarted."""
    pids = server.worker_pids()
    assert len(pids) == sum(TP.values()), pids
    out, i = {}, 0
    for name, tp in TP.items():
        out[name], i = pids[i:i + tp], i + tp
    return out


@dataclass
class KeyedServer:
    """A server that survives its tests (killed workers are restarted); it requires API_KEY.
    `ranks` follows restarts: the tests that kill a worker record the group's new pids."""

    server: Server
    ranks: dict[str, list[int]]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory) -> KeyedServer:
    srv = started(tmp_path_factory.mktemp("keyed"), API_KEY)
    yield KeyedServer(srv, ranks_at_startup(srv))
    srv.stop()


@pytest.fixture
def own(tmp_path) -> Server:
    """A server for one test that ends it; stopped anyway should the test fail first."""
    srv = started(tmp_path)
    yield srv
    srv.stop()


def client(server: Server, api_key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key=api_key, max_retries=0, timeout=60)


# ---- a worker dies mid-call ----------------------------------------------------------------

@pytest.mark.parametrize("instance, rank", [(COLD, 1), (HOT, 0)], ids=["cold-0-rank1", "hot-0-rank0"])
def test_sigkilled_worker_fails_its_call_promptly_and_the_instance_restarts(keyed, instance, rank):
    server, api = keyed.server, client(keyed.server)
    model, other = MODEL_OF[instance], HOT if instance == COLD else COLD
    old = keyed.ranks[instance]
    stream = api.completions.create(model=model, prompt="once upon a time", max_tokens=1500, temperature=0,
                                    stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)  # decoding is under way
    assert server.health().json()["instances"][instance]["in_flight"] == 1

    os.kill(old[rank], signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(openai.APIError) as info:
        for _ in chunks:
            pass
    assert time.monotonic() - killed_at < ERROR_WITHIN_S
    assert info.value.code == "instance_failed"
    assert instance in info.value.message and "retry" in info.value.message

    wait_for(lambda: server.health().status_code == 200, RECOVER_WITHIN_S, "healthy again")
    assert living(old) == []  # the survivors of the broken group were killed, not left behind
    new = [pid for pid in server.worker_pids() if pid not in keyed.ranks[other]]
    assert len(new) == len(old) and not set(new) & set(old)
    assert living(keyed.ranks[other]) == keyed.ranks[other]  # only the broken group restarted
    keyed.ranks[instance] = new
    again = api.completions.create(model=model, prompt="again", max_tokens=3, extra_body={"ignore_eos": True})
    assert again.usage.completion_tokens == 3
    assert api.completions.create(model=MODEL_OF[other], prompt="x", max_tokens=1).usage.completion_tokens == 1


# ---- API key -------------------------------------------------------------------------------

@pytest.mark.parametrize("headers, code", [
    ({}, "missing_api_key"),
    ({"authorization": "Bearer wrong-key"}, "invalid_api_key"),
    ({"authorization": API_KEY}, "missing_api_key"),  # the key without the Bearer scheme
], ids=["none", "wrong", "no-bearer"])
def test_api_key_is_required_on_v1(keyed, headers, code):
    body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}
    api = keyed.server.api
    for resp in (httpx.post(api + "/completions", json=body, headers=headers, timeout=30),
                 httpx.get(api + "/models", headers=headers, timeout=30)):
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["type"] == "authentication_error"
        assert resp.json()["error"]["code"] == code
        assert resp.headers["www-authenticate"] == "Bearer"


def test_api_key_lets_requests_through(keyed):
    api = client(keyed.server)
    assert {m.id for m in api.models.list()} == {"tiny-llama", "tiny-qwen3"}
    out = api.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        client(keyed.server, "wrong-key").models.list()


# ---- stopping the supervisor ---------------------------------------------------------------

# uvicorn handles SIGINT/SIGTERM by shutting down gracefully (our lifespan stops every engine group),
# then re-raises the signal with its previous handler: SIGTERM's default kills the process (-15 from
# Popen), while SIGINT lands in asyncio.run's handler after the main task is done, so `up` returns 0.
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 0)],
                         ids=["SIGTERM", "SIGINT"])
def test_signal_stops_the_supervisor_and_every_worker(own, sig, code):
    workers = own.worker_pids()
    everything = own.descendants()
    assert len(workers) == 3 and set(workers) <= set(everything)

    own.process.send_signal(sig)
    assert own.process.wait(STOP_WITHIN_S) == code
    assert living(workers) == []  # stopped and reaped by the supervisor itself, not by PDEATHSIG later
    wait_for(lambda: not living(everything), ORPHANS_GONE_WITHIN_S, "gone (multiprocessing's tracker too)")
    assert "stopping engine groups" in own.log()


def test_sigkilled_supervisor_leaves_no_orphan_worker(own):
    workers = own.worker_pids()
    everything = own.descendants()
    assert len(workers) == 3 and set(workers) <= set(everything)

    own.process.kill()
    own.process.wait(STOP_WITHIN_S)
    wait_for(lambda: not living(everything), ORPHANS_GONE_WITHIN_S, "gone after the supervisor was SIGKILLed")


# ---- the CLI explains itself ---------------------------------------------------------------

@pytest.mark.parametrize("args, phrases", [
    ([], ["talaria up", "up", "config"]),
    (["up"], ["--config", "--host", "--port", "--log-level", "SIGTERM"]),
    (["config"], ["check", "Validate"]),
    (["config", "check"], ["[FILE]", "--files", "exit code"]),
], ids=["talaria", "up", "config", "config-check"])
def test_help_exits_zero_and_explains(args, phrases):
    result = CliRunner().invoke(cli, [*args, "--help"], prog_name="talaria")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"Usage: {' '.join(['talaria', *args])} ")
    for phrase in phrases:
        assert phrase in result.output
