"""A port-in-use check before anything starts (TGI only finds out once the model has loaded)."""

from __future__ import annotations

import socket

from textgen_common.addresses import listen_address
from textgen_launcher.errors import PortInUse


def check_port_free(hostname: str, port: int, what: str) -> None:
    address = listen_address(hostname)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # Same option as the router's server: a port only in TIME_WAIT is free to it.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as exc:
            raise PortInUse(f"{what} {address}:{port} is not available: {exc.strerror}") from None
