"""Whether this process can own a TCP port, checked before anything starts listening on it.

libp2p's daemon (p2pd) listens with SO_REUSEPORT, so a second daemon on a taken port starts without complaint and
the two then share incoming connections. Binding a plain socket first (no SO_REUSEPORT) turns that into an error
at start-up. The port is released again at once; what listens on it next is the caller's business.
"""
from __future__ import annotations

import re
import socket

_TCP_MADDR = re.compile(r"\A/(ip4|ip6)/([^/]+)/tcp/(\d+)(?:/|\Z)")


def port_taken(host: str, port: int) -> str | None:
    """Why (host, port) cannot be listened on, or None when it can (port 0, any free port, always can)."""
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # SO_REUSEADDR only skips connections in TIME_WAIT; a listening socket still makes bind fail
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def tcp_listen_addresses(maddrs: tuple[str, ...] | list[str]) -> list[tuple[str, str, int]]:
    """(multiaddr, host, port) of every /ip4|ip6/HOST/tcp/PORT listen multiaddr; others are skipped."""
    found = []
    for maddr in maddrs:
        match = _TCP_MADDR.match(maddr)
        if match:
            found.append((maddr, match.group(2), int(match.group(3))))
    return found
