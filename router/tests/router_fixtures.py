"""Helpers of the router HTTP tests: a real `textgen-router` process on loopback, and the shared limits.

- `RouterProcess`: `textgen-router --master-shard-uds-path S --tokenizer-name M --port P ...` in its own
  process (forked from testing.preload's preloader where its environment allows), waited for (GET /health,
  bounded) and killed on exit, with its log kept for failures.
- `ROUTER_FLAGS`: the small limits and the API key of the shared router (fixtures in conftest.py), so every
  rule can be exercised without long prompts.
- `metric`: one series' value from a router's /metrics.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from testing.preload import PreloadedProcess, start_process
from textgen_common.ports import free_port

API_KEY = "Test-Key"
ALLOWED_ORIGIN = "http://allowed.example"
MAX_INPUT_TOKENS = 64
MAX_TOTAL_TOKENS = 512
MAX_CONCURRENT_REQUESTS = 3
PAYLOAD_LIMIT = 20_000
ROUTER_FLAGS = (
    "--max-input-tokens",
    str(MAX_INPUT_TOKENS),
    "--max-total-tokens",
    str(MAX_TOTAL_TOKENS),
    "--max-batch-prefill-tokens",
    "512",
    "--max-concurrent-requests",
    str(MAX_CONCURRENT_REQUESTS),
    "--payload-limit",
    str(PAYLOAD_LIMIT),
    "--api-key",
    API_KEY,
    "--cors-allow-origin",
    ALLOWED_ORIGIN,
)


def metric(client: httpx.Client, series: str) -> float:
    """The value of one series (name and labels, as /metrics prints them) on the router `client` talks to; 0 when
    it is not there yet."""
    match = re.search(rf"^{re.escape(series)} (\S+)$", client.get("/metrics").text, re.M)
    return float(match.group(1)) if match else 0.0


class RouterProcess(contextlib.AbstractContextManager):
    """A real `textgen-router` serving `model_dir` from the shard on `master_socket`."""

    def __init__(
        self,
        master_socket: str,
        model_dir: Path,
        flags: Sequence[str] = (),
        env: dict[str, str] | None = None,
        timeout: float = 120.0,
    ) -> None:
        self.port = free_port()
        self.prometheus_port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable,
            "-m",
            "textgen_router.main",
            "--master-shard-uds-path",
            master_socket,
            "--tokenizer-name",
            str(model_dir),
            "--hostname",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-port",
            str(self.prometheus_port),
            *flags,
        ]
        self.env = {**os.environ, **(env or {})}
        self.timeout = timeout
        fd, log_name = tempfile.mkstemp(prefix="tg-router-", suffix=".log")
        os.close(fd)  # start_process opens the log by name
        self.log_path = Path(log_name)
        self.process: subprocess.Popen | PreloadedProcess | None = None

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def __enter__(self) -> RouterProcess:
        try:
            self.process = start_process(self.cmd, self.env, self.log_path)
            self.wait_healthy()
        except BaseException:  # no __exit__ after a failed __enter__ (a start that fails or `make test-fast` refuses)
            self.__exit__()
            raise
        return self

    def wait_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"router exited with {self.process.returncode}:\n{self.log[-6000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.25)
        raise TimeoutError(f"router not healthy after {self.timeout}s:\n{self.log[-6000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        """Signal the router, wait (bounded), SIGKILL if needed; returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        return self.process.returncode

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.log_path.unlink(missing_ok=True)
