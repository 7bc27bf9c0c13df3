"""A real `textgen-launcher` process for lifecycle tests: started in its own session, output to a file,
waited on through HTTP /health, and never outliving its test."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import psutil

from launcher_invocation import launcher_env, short_uds_prefix


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Launched:
    def __init__(self, model: Path, extra: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.uds = short_uds_prefix()
        self.log_path = log_path
        self.started = time.monotonic()
        cmd = ["textgen-launcher", "--model-id", str(model), "--hostname", "127.0.0.1", "--port", str(self.port),
               "--prometheus-port", str(free_port()), "--shard-uds-path", self.uds,
               "--master-port", str(free_port()), *extra]
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(cmd, env=launcher_env(env), stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.known: list[psutil.Process] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def remember_children(self) -> None:
        """Every descendant now alive, to check later that none outlived the launcher."""
        self.known = psutil.Process(self.process.pid).children(recursive=True)

    def wait_healthy(self, timeout: float = 240.0) -> float:
        """Seconds from launch to the first 200 on /health."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"launcher exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    self.remember_children()
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"not healthy after {timeout}s:\n{self.log()}")

    def shard_pids(self) -> list[int]:
        return [p.pid for p in self.known if "serve" in p.cmdline()]

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launcher still running after {timeout}s:\n{self.log()}") from None

    def survivors(self) -> list[psutil.Process]:
        alive = []
        for proc in self.known:
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.NoSuchProcess:
                pass
        return alive

    def sockets_left(self) -> list[Path]:
        return sorted(Path("/tmp").glob(Path(self.uds).name + "*"))

    def kill(self) -> None:
        """Teardown: whatever a failed test left running goes, group and remembered children alike."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        for proc in self.survivors():
            proc.kill()
        for path in self.sockets_left():
            path.unlink(missing_ok=True)
