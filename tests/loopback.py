"""Real gateways on chosen loopback addresses and ports, for tests of several nodes on one machine.

127.0.0.0/8 is all loopback, so nodes can share a port on 127.0.0.1, .2 and .3 as pods behind a
headless Service share theirs; and one app can listen on two ports, a client and a peer port.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


def free_ports(count: int, hosts: tuple[str, ...] = HOSTS) -> list[int]:
    """`count` ports free on every one of `hosts`."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        if port not in ports:
            ports.append(port)
    return ports


@contextmanager
def serve_on(app, *addresses: tuple[str, int]) -> Iterator[None]:
    """`app` under uvicorn in a thread, listening on every (host, port) of `addresses` at once (the
    kernel queues connections until uvicorn accepts them: no start-up wait)."""
    import uvicorn

    socks = []
    for host, port in addresses:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        socks.append(sock)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": socks}, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        for sock in socks:
            sock.close()
