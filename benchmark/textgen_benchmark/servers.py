"""Server processes that benchmark scripts start and measure over HTTP: `Server` (its own process group, waited
on until healthy) and `scrape` (every sample of its Prometheus /metrics)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import httpx
import psutil


class Server:
    """A server process started by a benchmark script, in its own process group, waited on until healthy."""

    def __init__(self, name: str, argv: list[str], port: int, health: str, env: dict | None = None) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = open(f"/tmp/http_load_{name}.log", "w")
        self.proc = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
        )
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited early; see {self.log.name}")
            try:
                if httpx.get(self.url + health, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{name} not healthy after 300 s; see {self.log.name}")

    def cpu_seconds(self, cmd_fragment: str) -> float:
        procs = [psutil.Process(self.proc.pid)] + psutil.Process(self.proc.pid).children(recursive=True)
        total = 0.0
        for p in procs:
            try:
                if cmd_fragment in " ".join(p.cmdline()):
                    t = p.cpu_times()
                    total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


# One exposed sample: name, optional {labels}, value. (prometheus_client's parser would rename TGI's counters,
# which have no _total suffix, so the series are read as exposed.)
SAMPLE = re.compile(r"^(\S+?(?:\{[^}]*\})?) (\S+)$", re.M)
DECODE = '{method="decode"}'


def scrape(url: str) -> dict[str, float]:
    """Every sample of the server's /metrics, keyed as exposed: 'name{label="value"}' -> value."""
    return {series: float(value) for series, value in SAMPLE.findall(httpx.get(url + "/metrics", timeout=10).text)}
