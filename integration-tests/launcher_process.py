"""A real `textgen-launcher` process for tests, shared by every test directory of one pytest session.

`shared_launcher(model_dir)` is a context manager: the first user starts
`textgen-launcher --model-id M --hostname 127.0.0.1 --port P --shard-uds-path /tmp/tg-it-<id>-server` in its
own process group and waits (bounded) for GET /health; later users get the same process; the last one to
leave kills the whole group (launcher, router, shards). The launcher's log is printed if it fails to start.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

HEALTH_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Launcher:
    base_url: str
    model_dir: Path
    process: subprocess.Popen
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float) -> None:
        """Poll GET /health; fail fast (with the log) if the launcher exits, or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"Launcher crashed (exit {self.process.returncode}):\n{self.log[-8000:]}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"Health check failed after {timeout}s:\n{self.log[-8000:]}")

    def stop(self) -> None:
        """SIGTERM the launcher's process group (launcher, router, shards); SIGKILL what is left."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.wait(timeout=10)
        self.log_path.unlink(missing_ok=True)


def start_launcher(model_dir: Path, extra_args: Sequence[str] = ()) -> Launcher:
    """Start a launcher of its own (not shared) with `extra_args` appended, and wait until it is healthy."""
    port = free_port()
    cmd = [
        "textgen-launcher",
        "--model-id", str(model_dir),
        "--hostname", "127.0.0.1",
        "--port", str(port),
        "--prometheus-port", str(free_port()),
        "--master-port", str(free_port()),
        "--shard-uds-path", f"/tmp/tg-it-{uuid.uuid4().hex[:8]}-server",
        *extra_args,
    ]  # fmt: skip
    env = dict(os.environ, LOG_LEVEL="info", USAGE_STATS="off")
    fd, log_name = tempfile.mkstemp(prefix="tg-it-launcher-", suffix=".log")
    with os.fdopen(fd, "wb") as log_file:
        # Own process group: stop() reaches the router and shards even if the launcher is stuck.
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    handle = Launcher(f"http://127.0.0.1:{port}", model_dir, process, Path(log_name))
    try:
        handle.wait_healthy(HEALTH_TIMEOUT_S)
    except BaseException:
        print(handle.log[-8000:], file=sys.stderr)
        handle.stop()
        raise
    return handle


_running: dict[Path, tuple[Launcher, int]] = {}


@contextlib.contextmanager
def shared_launcher(model_dir: Path) -> Iterator[Launcher]:
    """One launcher per model for the whole session, however many test directories ask for it."""
    if model_dir in _running:
        handle, users = _running[model_dir]
        _running[model_dir] = (handle, users + 1)
    else:
        handle = start_launcher(model_dir)
        _running[model_dir] = (handle, 1)
    try:
        yield handle
    finally:
        handle, users = _running[model_dir]
        if users == 1:
            del _running[model_dir]
            handle.stop()
        else:
            _running[model_dir] = (handle, users - 1)
