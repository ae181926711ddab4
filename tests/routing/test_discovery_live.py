"""Peer discovery by DNS, live: three real `talaria up` nodes on loopback that find each other by name.

Nodes A, B and C listen on 127.0.0.1, .2 and .3, each on the same client port and the same peer
port, as pods behind a headless Service do. Every node has `peer_dns = "talaria-peers.test:PEER_PORT"`
and the peer key in TALARIA_PEER_KEY; the name resolves to whatever the test last wrote in a file
(tests/routing/fake_dns.py: the only fake, since changing what a name resolves to takes root). A
serves tiny-a; B and C serve tiny-b, so each node forwards a call for a model only another serves,
and tiny-b has a replica to fall back on.

1. All three find each other (each excludes its own address) and each forwards a call.
2. Under load (calls to A for tiny-b, to B for tiny-a), C is killed while its address still
   resolves (DNS lags a pod that died): A and B mark it down within two intervals and place nothing
   there after; then the name drops it, and within two intervals it leaves their peer sets. No call
   fails but those in flight when C died: calls A placed on the dead C are placed again on B.
3. C starts again at its address and the name lists it: within two intervals of its being healthy,
   A and B have it up again, C has them, and A places tiny-b calls on it again.

The timeline is printed (run with -s to see it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import Server, tiny_llama_toml, wait_for
from tests.loopback import free_ports
from tests.routing.fake_dns import ADDRESSES_ENV, NAME, write_addresses

pytestmark = pytest.mark.slow

INTERVAL_S = 1.0  # peer_dns_interval_s
HEARTBEAT_S = 0.5
PEER_KEY = "peer-set-key"
HOSTS = {"a": "127.0.0.1", "b": "127.0.0.2", "c": "127.0.0.3"}
SERVES = {"a": "tiny-a", "b": "tiny-b", "c": "tiny-b"}
MAX_TOKENS = 8
PACE_S = 0.1  # each load client waits this long between calls: C must start again beside the load
FAKE_DNS = Path(__file__).with_name("fake_dns.py")


def node_config(folder: Path, node: str, peer_port: int) -> Path:
    text = (f'[server]\nhost = "{HOSTS[node]}"\npeer_port = {peer_port}\ndrain_s = 5.0\n\n'
            + tiny_llama_toml("tiny-a", 1) + "\n" + tiny_llama_toml("tiny-b", 2) + "\n"
            + f'[[instances]]\nname = "hot-{node}"\npool = "hot"\nmodels = ["{SERVES[node]}"]\n'
            'arena_bytes = "64MiB"\nhost_kv_bytes = "8MiB"\n\n'
            f'[router]\npolicy = "least-pressure"\nheartbeat_s = {HEARTBEAT_S}\n'
            f'peer_dns = "{NAME}:{peer_port}"\npeer_dns_interval_s = {INTERVAL_S}\n\n'
            f'[telemetry]\nevents_path = "{folder / "events.jsonl"}"\n')
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "talaria.toml").write_text(text)
    return folder / "talaria.toml"


def start_node(folder: Path, node: str, port: int, peer_port: int, names: Path) -> Server:
    config = node_config(folder, node, peer_port)
    log = (folder / "talaria.log").open("w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", ADDRESSES_ENV: str(names), "TALARIA_PEER_KEY": PEER_KEY}
    proc = subprocess.Popen([sys.executable, str(FAKE_DNS), "up", "--config", str(config), "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    return Server(proc, f"http://{HOSTS[node]}:{port}", folder / "talaria.log")


def telemetry(server: Server) -> dict:
    return server.telemetry(timeout=5).json()


def members(server: Server) -> dict[str, dict]:
    return {m["url"]: m for m in telemetry(server)["router"]["peers"]["members"]}


def events(folder: Path, kind: str) -> list[dict]:
    lines = (folder / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, filter(str.strip, lines)) if e["kind"] == kind]


def completion(client: httpx.Client, server: Server, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "Read the file, then summarise it.", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    return client.post(server.base_url + "/v1/completions", json=body)


@dataclass
class Call:
    node: str
    model: str
    start: float
    end: float
    status: int | str  # the HTTP status, or the client's exception


class Load:
    """Threads that call nodes back to back until stopped, each call recorded."""

    def __init__(self, targets: list[tuple[str, Server, str]]) -> None:
        self.calls: list[Call] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=t, daemon=True) for t in targets]

    def _run(self, node: str, server: Server, model: str) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    status: int | str = completion(client, server, model).status_code
                except httpx.HTTPError as e:
                    status = type(e).__name__
                self.calls.append(Call(node, model, start, time.monotonic(), status))
                self._stop.wait(PACE_S)

    @contextmanager
    def running(self) -> Iterator[Load]:
        for t in self._threads:
            t.start()
        try:
            yield self
        finally:
            self._stop.set()
            for t in self._threads:
                t.join(60)


def view_of(node: str, peer_port: int) -> str:
    return f"{HOSTS[node]}:{peer_port}/hot-{node}"


def url_of(node: str, peer_port: int) -> str:
    return f"http://{HOSTS[node]}:{peer_port}"


def peers_up(server: Server, expected: set[str]) -> bool:
    found = members(server)
    return set(found) == expected and all(m["state"] == "up" and m["healthy_instances"] == 1 for m in found.values())


def test_three_nodes_find_each_other_by_name_drop_a_dead_one_and_take_it_back(tmp_path):
    port, peer_port = free_ports(2)
    names = tmp_path / "names"
    write_addresses(names, list(HOSTS.values()))
    folders = {n: tmp_path / n for n in HOSTS}
    nodes = {n: start_node(folders[n], n, port, peer_port, names) for n in HOSTS}
    urls = {n: url_of(n, peer_port) for n in HOSTS}
    timeline: list[str] = []
    t0 = time.monotonic()

    def note(what: str) -> None:
        timeline.append(f"{time.monotonic() - t0:7.2f} s  {what}")

    try:
        for server in nodes.values():
            server.wait_healthy()
        note("A, B, C healthy")
        for n, server in nodes.items():
            others = {urls[o] for o in HOSTS if o != n}
            wait_for(lambda s=server, o=others: peers_up(s, o), 5 * INTERVAL_S, f"{n} with the other two up")
        note("each has the other two as peers, up")

        # 1. each node forwards a call for a model only another node serves
        with httpx.Client(timeout=60) as client:
            for n, model in (("a", "tiny-b"), ("b", "tiny-a"), ("c", "tiny-a")):
                r = completion(client, nodes[n], model)
                assert r.status_code == 200, r.text
        routed = {n: [e["target"] for e in events(folders[n], "route") if e["model"] != SERVES[n]] for n in HOSTS}
        assert routed["a"] in ([view_of("b", peer_port)], [view_of("c", peer_port)]), routed
        assert routed["b"] == routed["c"] == [view_of("a", peer_port)], routed
        note(f"A forwarded tiny-b to {routed['a'][0]}, B and C forwarded tiny-a to {routed['b'][0]}")

        # 2. C dies while its address still resolves, then the name drops it
        load = Load([("a", nodes["a"], "tiny-b"), ("a", nodes["a"], "tiny-b"), ("b", nodes["b"], "tiny-a")])
        with load.running():
            wait_for(lambda: len(load.calls) >= 6, 30, "the load running")
            killed = time.monotonic()
            nodes["c"].process.send_signal(signal.SIGKILL)
            nodes["c"].process.wait(10)
            note("C killed (its address still resolves)")
            for n in ("a", "b"):
                wait_for(lambda s=nodes[n]: members(s)[urls["c"]]["state"] == "down", 2 * INTERVAL_S,
                         f"C down at {n}")
            down = {n: next(e["t"] for e in events(folders[n], "peer") if e["op"] == "down"
                            and e["peer"] == urls["c"] and e["t"] > killed) - killed for n in ("a", "b")}
            note(f"C down at A after {down['a']:.2f} s, at B after {down['b']:.2f} s")
            wait_for(lambda: sum(c.start > killed for c in load.calls) >= 4, 30, "calls after C died")
            removed = time.monotonic()
            write_addresses(names, [HOSTS["a"], HOSTS["b"]])
            for n in ("a", "b"):
                wait_for(lambda s=nodes[n]: urls["c"] not in members(s), 2 * INTERVAL_S, f"C gone from {n}")
            left = {n: next(e["t"] for e in events(folders[n], "peer") if e["op"] == "left"
                            and e["peer"] == urls["c"] and e["t"] > removed) - removed for n in ("a", "b")}
            note(f"C no longer resolves: it left A after {left['a']:.2f} s, B after {left['b']:.2f} s")
            assert not any(v["healthy"] for name, v in telemetry(nodes["a"])["router"]["views"].items()
                           if name.startswith(HOSTS["c"]))

            # 3. C comes back at its address
            write_addresses(names, list(HOSTS.values()))
            nodes["c"] = start_node(tmp_path / "c-again", "c", port, peer_port, names)
            nodes["c"].wait_healthy()
            healthy = time.monotonic()
            note("C started again and healthy")
            for n, server in nodes.items():
                others = {urls[o] for o in HOSTS if o != n}
                wait_for(lambda s=server, o=others: peers_up(s, o), 2 * INTERVAL_S, f"{n} with the other two up")
            note(f"A, B and C all have each other up again, {time.monotonic() - healthy:.2f} s after C was healthy")
            back = time.monotonic()
            wait_for(lambda: any(e["target"] == view_of("c", peer_port) and e["t"] > back
                                 for e in events(folders["a"], "route")), 30, "A placing a call on C again")
            note("A places tiny-b calls on C again")
        with httpx.Client(timeout=60) as client:
            assert completion(client, nodes["c"], "tiny-a").status_code == 200  # C forwards to A again
    finally:
        for server in nodes.values():
            server.stop()
        print("\n" + "\n".join(timeline))

    # dropped within two intervals, and nothing placed there after
    assert max(down.values()) < 2 * INTERVAL_S, down
    assert max(left.values()) < 2 * INTERVAL_S, left
    for n in ("a", "b"):
        dropped_at = killed + down[n]
        up_again = next(e["t"] for e in events(folders[n], "peer") if e["op"] == "up" and e["peer"] == urls["c"]
                        and e["t"] > killed)
        late = [e for e in events(folders[n], "route") if e["target"] == view_of("c", peer_port)
                and dropped_at < e["t"] < up_again]
        assert late == [], f"{n} placed calls on C between dropping it and its coming back: {late}"
    # no call lost but those in flight on C when it died
    failed = [c for c in load.calls if c.status != 200]
    in_flight = [c for c in failed if c.start < killed < c.end and c.model == "tiny-b"]
    assert failed == in_flight, failed
    assert len(failed) <= 2, failed  # two clients called A for tiny-b: at most one call each was on C
    after = [c for c in load.calls if c.start > killed]
    requests = [e["request"] for e in events(folders["a"], "route")]
    again = len(requests) - len(set(requests))  # placed on the dead C, refused, placed again
    print(f"{len(load.calls)} calls under load, {len(after)} after C died, {len(failed)} failed (in flight on C), "
          f"{again} placed again after the dead C refused the connection")
