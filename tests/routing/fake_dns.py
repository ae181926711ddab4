"""A fake of DNS for the live discovery test: the one thing in it that cannot be arranged for real.

Making a name resolve to three loopback addresses, and changing what it resolves to while the
nodes run, takes root (/etc/hosts) or a DNS server that the machine's resolver asks; a test has
neither. So a node started as `python tests/routing/fake_dns.py up ...` answers `socket.getaddrinfo`
for one name, `NAME`, from a file the test rewrites (one address per line; an empty file is a name
that does not exist), and resolves every other name as usual. From the resolved addresses on
(`PeerSet.discover`, the peer links, the router, the forwarding) everything is the node's own code.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

NAME = "talaria-peers.test"
ADDRESSES_ENV = "TALARIA_TEST_PEER_ADDRESSES"  # the file's path


def install(path: Path) -> None:
    real = socket.getaddrinfo

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        if host != NAME:
            return real(host, port, family, type, proto, flags)
        addresses = path.read_text().split()
        if not addresses:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (a, int(port))) for a in addresses]
    socket.getaddrinfo = getaddrinfo


def write_addresses(path: Path, addresses: list[str]) -> None:
    """What NAME resolves to from now on, written whole (a reader never sees half a list)."""
    part = path.with_suffix(".part")
    part.write_text("\n".join(addresses) + "\n")
    part.replace(path)


if __name__ == "__main__":
    install(Path(os.environ[ADDRESSES_ENV]))
    from talaria.cli.main import cli

    cli(sys.argv[1:], prog_name="talaria")
