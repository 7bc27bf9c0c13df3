"""One container of textgen's image, run with docker or podman as the README says, for the image test."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import httpx

from deploy.image import rlimit_flags

HEALTH_TIMEOUT_S = 600.0  # a first start builds the CPU ops into the volume


def engine_run(tool: str, *args: str, timeout: float = 600) -> str:
    """`tool args...`'s output; raises with its stderr on failure."""
    done = subprocess.run([tool, *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


class Container:
    """`<tool> run -d -p PORT:80 -v DATA:/data IMAGE ARGS...` under a unique name: the README's command, with the
    engine's own network and HOSTNAME (the container's short id, not an address)."""

    def __init__(self, tool: str, image: str, data: Path, port: int, args: Sequence[str], memory: str | None = None):
        self.tool, self.port = tool, port
        self.name = f"textgen-image-test-{uuid.uuid4().hex[:8]}"
        self.base_url = f"http://127.0.0.1:{port}"
        limits = ["--memory", memory] if memory else []
        self.started = time.monotonic()
        engine_run(
            tool, "run", "-d", "--name", self.name, "-p", f"{port}:80", *rlimit_flags(tool, image), *limits,
            "-v", f"{data}:/data", image, *args,
        )  # fmt: skip

    def wait_healthy(self, timeout: float = HEALTH_TIMEOUT_S) -> float:
        """Seconds from `run` to the first 200 on /health."""
        while time.monotonic() - self.started < timeout:
            if not self.running():
                raise RuntimeError(f"container exited before it was healthy:\n{self.logs()[-4000:]}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"not healthy in {timeout:.0f} s:\n{self.logs()[-4000:]}")

    def running(self) -> bool:
        return self.inspect("{{.State.Running}}") == "true"

    def inspect(self, template: str) -> str:
        return engine_run(self.tool, "inspect", "--format", template, self.name).strip()

    def exec(self, *command: str) -> str:
        return engine_run(self.tool, "exec", self.name, *command)

    def logs(self) -> str:
        done = subprocess.run([self.tool, "logs", self.name], capture_output=True, text=True, timeout=60)
        return done.stdout + done.stderr

    def stop(self, timeout: int) -> int:
        """`<tool> stop -t timeout` (SIGTERM, SIGKILL after `timeout` s): the container's exit code."""
        engine_run(self.tool, "stop", "-t", str(timeout), self.name, timeout=timeout + 60)
        return int(self.inspect("{{.State.ExitCode}}"))

    def remove(self) -> None:
        subprocess.run([self.tool, "rm", "-f", self.name], capture_output=True, timeout=120)
