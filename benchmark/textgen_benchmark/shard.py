"""Real shard processes for benchmarks: the cached "small" model, `start_shard` / `stop`, and CPU time."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import psutil

REPO = Path(__file__).resolve().parents[2]


def cached_llama(size: str) -> Path:
    """The cached Llama build of `size` under models/ (keyed by builder version so a stale build is never used)."""
    from textgen_server.builder import BUILDER_VERSION, build_test_model

    name = "small-llama" if size == "small" else f"llama-{size}"
    return build_test_model(REPO / "models" / f"{name}-v{BUILDER_VERSION}", arch="llama", size=size)


def small_model() -> Path:
    """The cached "small" build under models/ (`models/small-llama-v<builder version>`)."""
    return cached_llama("small")


DTYPES = ("float32", "bfloat16", "float16")  # a shard's --dtype choices


class Process(Protocol):
    """What start_shard and stop use of a started process (`subprocess.Popen`'s)."""

    pid: int

    def poll(self) -> int | None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...


def exec_process(cmd: list[str], env: dict[str, str], log_path: Path) -> Process:
    """`cmd` exec'd with `env`, its output written to `log_path`."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


# How start_shard starts a shard: exec'd, as a user's is. The suite runs the scripts in its own process and forks
# their shards from its preloader instead (benchmark/tests/conftest.py, testing/preload.py): the same serve entry
# point without the 5-7 s of CPU its imports take on each start.
start_process: Callable[[list[str], dict[str, str], Path], Process] = exec_process


def start_shard(
    model_dir: Path,
    uds_path: str,
    threads: int,
    timeout: float = 300.0,
    dtype: str = "float32",
    extra_env: dict[str, str] | None = None,
    extra_args: Sequence[str] = (),
) -> Process:
    """A real shard process (`--dtype dtype` and `extra_args`, `extra_env` added to its environment) limited to
    `threads` cores; returns once Health answers (or raises)."""
    import grpc

    from textgen_pb import generate_pb2, generate_pb2_grpc

    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), **(extra_env or {}))
    log = Path(tempfile.gettempdir()) / "textgen-bench-shard.log"
    proc = start_process(
        [
            *(sys.executable, "-m", "textgen_server.cli", "serve", str(model_dir)),
            *("--uds-path", uds_path, "--dtype", dtype, *extra_args),
        ],
        env,
        log,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise RuntimeError(f"shard exited with {code}; see {log}")
        if os.path.exists(f"{uds_path}-0"):
            with grpc.insecure_channel(f"unix://{uds_path}-0") as channel:
                try:
                    generate_pb2_grpc.TextGenerationServiceStub(channel).Health(generate_pb2.HealthRequest(), timeout=5)
                    return proc
                except grpc.RpcError:
                    pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"shard not ready after {timeout}s; see {log}")


def stop(proc: Process) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system
