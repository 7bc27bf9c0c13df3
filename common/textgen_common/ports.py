"""Loopback TCP ports for the servers that tests and benchmark scripts start (`free_port`)."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (bind to 0, and every outgoing connection)."""
    with contextlib.suppress(OSError, ValueError):
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    return 32768, 60999  # Linux's default


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback TCP port nobody holds now, for a process started later to bind.

    Nothing reserves it in between, so it is drawn outside the ephemeral range: a port from bind(0) can be
    taken first by any outgoing connection of the session (HTTP clients, gRPC channels, torch's store),
    and then the server that was meant to bind it fails with "address in use". Ports already handed out
    in this process are skipped, so one launcher never gets the same port twice.
    """
    low, high = _ephemeral_ports()
    below, above = (1024, low) if low - 1024 >= 4096 else (high + 1, 65536)
    while True:
        port = random.randrange(below, above)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
