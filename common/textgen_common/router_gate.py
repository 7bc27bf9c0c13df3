"""The launcher's gate in front of the router: the router starts while the shards load, and connects when told.

Contract between `textgen-launcher` and `textgen-router`: the launcher starts the router as soon as it has
started the shards, with `GATE_ENV=1` in its environment and a pipe on its stdin. The router imports, loads its
tokenizer and chat template (seconds of CPU, on a core the loading shards leave free), then reads one line from
stdin before it connects to the master shard: `READY` once every shard answers Health; end of file (the
launcher stopped, or its shards failed) means it must not connect and exits. Without `GATE_ENV` (a router
started by hand, as TGI's), the router connects at once.
"""

from __future__ import annotations

import os
import sys

GATE_ENV = "TEXTGEN_ROUTER_GATE"
READY = "shards-ready"


def gated() -> bool:
    """Whether this router was started by the launcher behind the gate."""
    return os.environ.get(GATE_ENV) == "1"


def wait_until_open() -> bool:
    """Blocks until the launcher writes READY (True) or closes the pipe without it (False)."""
    return sys.stdin.readline().strip() == READY
