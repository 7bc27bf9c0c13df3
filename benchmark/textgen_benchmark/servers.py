"""Server processes that benchmark scripts start and measure over HTTP: `Server` (its own process group, waited
on until healthy), `Launcher` (a `textgen-launcher` on loopback as a Server), `scrape` (every sample of its
Prometheus /metrics) and `growth` (what grew between two scrapes)."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import time

import httpx
import psutil

from textgen_common.ports import free_port


def log_path(name: str) -> str:
    """Where the Server named `name` writes its output (read it when the start fails)."""
    return f"/tmp/http_load_{name}.log"


class Server:
    """A server process started by a benchmark script, in its own process group, waited on until healthy."""

    def __init__(self, name: str, argv: list[str], port: int, health: str, env: dict | None = None) -> None:
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        self.log = open(log_path(name), "w")
        self.proc = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
        )
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.stop()  # children it left behind, if any
                raise RuntimeError(f"{name} exited early; see {self.log.name}")
            try:
                if httpx.get(self.url + health, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{name} not healthy after 300 s; see {self.log.name}")

    def processes(self) -> list[tuple[psutil.Process, list[str]]]:
        """This server's process and its descendants with their command lines (one that exits meanwhile is
        left out)."""
        root = psutil.Process(self.proc.pid)
        found = []
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                found.append((p, p.cmdline()))
        return found

    def cpu_seconds(self, cmd_fragment: str) -> float:
        """User + system CPU seconds of the processes whose command line contains `cmd_fragment`."""
        total = 0.0
        for p, argv in self.processes():
            if cmd_fragment in " ".join(argv):
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    total += t.user + t.system
        return total

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after 60 s; a group already gone is fine."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()


class Launcher(Server):
    """`textgen-launcher --model-id model *args` on 127.0.0.1 as the Server `name`: free ports for HTTP, the
    router's Prometheus listener and torch.distributed's master (other sessions' shards may hold the defaults),
    its own shard socket, no hub access; `env` is added to its environment (and so its shard's and router's).
    `router` and `shards` are its router and shard processes (looked up when first read)."""

    def __init__(self, name: str, model: str, args: list[str], env: dict[str, str]) -> None:
        port = free_port()
        argv = ["textgen-launcher", "--model-id", model, "--hostname", "127.0.0.1", "--port", str(port)]
        argv += ["--prometheus-port", str(free_port()), "--master-port", str(free_port())]
        argv += ["--shard-uds-path", f"/tmp/{name}-{port}", *args]
        super().__init__(name, argv, port, "/health", {"HF_HUB_OFFLINE": "1", "USAGE_STATS": "off", **env})

    @functools.cached_property
    def router(self) -> psutil.Process:
        return next(p for p, argv in self.processes() if "textgen-router" in " ".join(argv))

    @functools.cached_property
    def shards(self) -> list[psutil.Process]:
        return [p for p, argv in self.processes() if "serve" in argv]


# One exposed sample: name, optional {labels}, value. (prometheus_client's parser would rename TGI's counters,
# which have no _total suffix, so the series are read as exposed.)
SAMPLE = re.compile(r"^(\S+?(?:\{[^}]*\})?) (\S+)$", re.M)
DECODE = '{method="decode"}'
PREFILL = '{method="prefill"}'


def scrape(url: str) -> dict[str, float]:
    """Every sample of the server's /metrics, keyed as exposed: 'name{label="value"}' -> value."""
    return {series: float(value) for series, value in SAMPLE.findall(httpx.get(url + "/metrics", timeout=10).text)}


def growth(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """How much each series of the scrape `after` grew since the scrape `before` (a new series from 0)."""
    return {series: value - before.get(series, 0.0) for series, value in after.items()}
