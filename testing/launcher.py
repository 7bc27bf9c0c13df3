"""A real `textgen-launcher` process for tests (the repo-root conftest exposes it as the `launcher` fixture).

`LauncherProcess` spawns `textgen-launcher --model-id M --hostname 127.0.0.1 --port P --prometheus-port Q
--master-port R --shard-uds-path /tmp/tgl-<id> ARGS...` in its own process group (so teardown reaches the
router and shards even when the launcher is stuck), with its output in a log file and an environment cleared of
the device and flag variables a developer's shell could set. `wait_healthy` polls GET /health (bounded); `stop`
ends the whole group and everything it ever spawned, and removes every socket and the log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
import psutil

from testing.shards import OUTPUT_VARS
from textgen_common.ports import free_port

HEALTH_TIMEOUT_S = 240.0
LOG_TAIL_CHARS = 8000
DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")
# Env vars of launcher flags that a developer's shell could set and that would change what a test means.
FLAG_VARS = (
    "MODEL_ID",
    "NUM_SHARD",
    "SHARDED",
    "PORT",
    "HOSTNAME",
    "MAX_INPUT_TOKENS",
    "MAX_TOTAL_TOKENS",
    "MAX_INPUT_LENGTH",
    "MAX_BATCH_PREFILL_TOKENS",
    "MAX_BATCH_TOTAL_TOKENS",
    "QUANTIZE",
    "API_KEY",
    "SHARD_UDS_PATH",
    "JSON_OUTPUT",
    "LOG_LEVEL",
    "ATTENTION",
    "PREFIX_CACHING",
    "ENABLE_PREFILL_LOGPROBS",
    *OUTPUT_VARS,  # the shards' own variables, which the launcher passes on
)


def short_uds_prefix() -> str:
    """Short and unique: AF_UNIX paths must stay under ~100 characters."""
    return f"/tmp/tgl-{uuid.uuid4().hex[:10]}"


def launcher_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DEVICE_VARS + FLAG_VARS}
    env["HF_HUB_OFFLINE"] = "1"  # no hub is reachable: fail fast instead of waiting on the network
    env["USAGE_STATS"] = "off"
    env.update(extra or {})
    return env


def run_launcher(
    args: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """Run `textgen-launcher ARGS` to completion (for invocations that must exit on their own)."""
    return subprocess.run(
        ["textgen-launcher", *args], env=launcher_env(env), capture_output=True, text=True, timeout=timeout
    )


class LauncherProcess:
    """One running `textgen-launcher` serving `model_dir` on a loopback port; see the module docstring."""

    def __init__(
        self, model_dir: str | os.PathLike, args: Sequence[str] = (), env: Mapping[str, str] | None = None
    ) -> None:
        self.model_dir = Path(model_dir)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.uds = short_uds_prefix()
        fd, log_name = tempfile.mkstemp(prefix="tgl-launcher-", suffix=".log")
        self.log_path = Path(log_name)
        self.known: list[psutil.Process] = []
        cmd = [
            "textgen-launcher",
            "--model-id",
            str(model_dir),
            "--hostname",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-port",
            str(free_port()),
            "--master-port",
            str(free_port()),
            "--shard-uds-path",
            self.uds,
            *args,
        ]
        self.started = time.monotonic()
        with os.fdopen(fd, "wb") as log_file:
            try:
                self.process = subprocess.Popen(
                    cmd, stdout=log_file, stderr=subprocess.STDOUT, env=launcher_env(env), start_new_session=True
                )
            except BaseException:  # no launcher (or `make test-fast` refusing it): no log to keep
                self.log_path.unlink()
                raise

    @property
    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def remember_children(self) -> None:
        """Every descendant now alive, to check later (and make sure at teardown) that none outlived the launcher."""
        with contextlib.suppress(psutil.NoSuchProcess):
            self.known = psutil.Process(self.process.pid).children(recursive=True)

    def wait_healthy(self, timeout: float = HEALTH_TIMEOUT_S) -> float:
        """Seconds from launch to the first 200 on /health; fails fast (with the log) if the launcher exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"launcher exited with {self.process.returncode}:\n{self.log[-LOG_TAIL_CHARS:]}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    self.remember_children()
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"launcher not healthy after {timeout}s:\n{self.log[-LOG_TAIL_CHARS:]}")

    def shard_pids(self) -> list[int]:
        return [p.pid for p in self.known if "serve" in p.cmdline()]

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launcher still running after {timeout}s:\n{self.log[-LOG_TAIL_CHARS:]}") from None

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

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL it after `grace` seconds, then every remembered descendant;
        remove sockets and the log. Safe to call twice."""
        if self.process.poll() is None:
            self.remember_children()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=grace)
        # A child may have left the group (or outlived its parent): kill what is left either way.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.wait(timeout=10)
        for proc in self.survivors():
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        for path in self.sockets_left():
            path.unlink(missing_ok=True)
        self.log_path.unlink(missing_ok=True)
