"""`[server] peer_port`: one gateway on two real sockets, a client port and a peer port.

The peer key opens the peer port only, and the peer port opens to the peer key only (`/health` and
`/metrics` aside): that is what lets a network policy confine the peer key's rights to the node set.
Which port a request came in on is the listening socket's, so the test serves the app on both.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from talaria.config.schema import ServerConfig
from talaria.gateway.gateway import create_app
from tests.gateway.fakes import MODEL, FakeEchoGroup, FakeEchoSupervisor
from tests.loopback import free_ports, serve_on

USER, ADMIN, PEER = "user-key", "admin-key", "peer-key"
HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def ports() -> Iterator[tuple[str, str]]:
    """(client URL, peer URL) of one gateway."""
    port, peer_port = free_ports(2, (HOST,))
    server = ServerConfig(api_key=USER, admin_key=ADMIN, peer_key=PEER, port=port, peer_port=peer_port)
    app = create_app(FakeEchoSupervisor([FakeEchoGroup("hot-0")], server=server))
    with serve_on(app, (HOST, port), (HOST, peer_port)):
        yield f"http://{HOST}:{port}", f"http://{HOST}:{peer_port}"


def status(method: str, url: str, key: str | None, tenant: bool = False) -> int:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if tenant:
        headers["x-talaria-tenant"] = "team-a"
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 2} if method == "POST" else None
    return httpx.request(method, url, headers=headers, json=body, timeout=10).status_code


CASES = [  # (port, method, path, key, forwarded) -> status
    ("client", "POST", "/v1/completions", USER, False, 200),
    ("client", "POST", "/v1/completions", PEER, True, 401),  # the peer key is no key here
    ("client", "GET", "/talaria/telemetry", ADMIN, False, 200),
    ("client", "GET", "/talaria/telemetry", PEER, False, 403),
    ("client", "GET", "/health", None, False, 200),
    ("peer", "GET", "/talaria/telemetry", PEER, False, 200),
    ("peer", "GET", "/talaria/telemetry", ADMIN, False, 403),
    ("peer", "POST", "/v1/completions", PEER, True, 200),  # a forwarded call
    ("peer", "POST", "/v1/completions", USER, False, 403),
    ("peer", "POST", "/v1/completions", None, False, 401),
    ("peer", "GET", "/v1/models", USER, False, 403),
    ("peer", "POST", "/talaria/admin/drain", ADMIN, False, 403),
    ("peer", "GET", "/health", None, False, 200),
    ("peer", "GET", "/metrics", None, False, 200),
]


@pytest.mark.parametrize("port, method, path, key, forwarded, expected", CASES,
                         ids=[f"{c[0]}-{c[1]}{c[2]}-{c[3] or 'nokey'}" for c in CASES])
def test_the_peer_key_opens_the_peer_port_and_nothing_else_does(ports, port, method, path, key, forwarded, expected):
    client_url, peer_url = ports
    base = peer_url if port == "peer" else client_url
    assert status(method, base + path, key, forwarded) == expected
