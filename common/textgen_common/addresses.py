"""Which address a server binds for the `--hostname` it was given (the router's, and the launcher's check)."""

from __future__ import annotations

import ipaddress

ANY_ADDRESS = "0.0.0.0"


def listen_address(hostname: str) -> str:
    """`hostname` itself when it is an IP literal, else 0.0.0.0: TGI binds only IP literals, and Docker sets
    HOSTNAME to the container's name."""
    try:
        ipaddress.ip_address(hostname)
    except ValueError:
        return ANY_ADDRESS
    return hostname
