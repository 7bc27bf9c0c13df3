"""Real `textgen-server serve` processes for tests, one per rank, on short unique unix sockets.

- `spawn_shards(model_dir, uds_path=None, env=None, extra_args=(), num_shard=1, timeout=120.0)`: spawns
  `textgen-server serve MODEL --uds-path P` (with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT and `--sharded`
  when num_shard > 1) and waits until Health answers on every rank's socket (bounded; a dead process fails
  fast with its log). Returns a `ShardHandle`; the caller stops it. Each rank is forked from the test process's
  preloader (testing.preload: torch and transformers imported once) unless its environment differs in a variable
  those imports could have read; then it is exec'd (`testing.preload.start_process`).
- `ShardProcess(model_dir, ...)`: the same as a context manager (`with ShardProcess(tiny_llama) as shard:`),
  for module- or session-scoped fixtures.
- `ShardHandle`: `.uds_path` (the prefix), `.socket` (rank-0 socket path), `.sockets`, `.url` (rank-0
  `unix://` url), `.urls`, `.process` (rank 0), `.processes`, `.log` (rank-0 log text), `.stub(rank=0)`
  (a sync `TextGenerationServiceStub`, channel closed by `.stop()`), `.stop()`.
- `shard_stub(socket_path)`: a sync stub on any socket path, as a context manager closing its channel.
- `unique_uds_path()`: a short unique socket prefix under /tmp (AF_UNIX paths must stay < 100 chars).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from testing.preload import PreloadedProcess, start_process
from textgen_common.grpc_options import GRPC_OPTIONS
from textgen_common.ports import free_port

# TGI's shard variables that change what a shard answers: a test sets them through `env`, never from the
# developer's shell (REQUEST_LOGPROBS=1 there turned the paged engine's prompt logprobs on for every shard).
OUTPUT_VARS = ("REQUEST_LOGPROBS", "ROPE_SCALING", "ROPE_FACTOR")


def unique_uds_path() -> str:
    return f"/tmp/tg-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def shard_stub(socket_path: str) -> Iterator[Any]:
    """A sync generate.v3 stub on a shard's unix socket path; the channel is closed on exit.

    Typed Any: the generated _grpc module has no type stubs (the stub sets its methods in __init__).
    """
    from textgen_pb import generate_pb2_grpc

    channel = grpc.insecure_channel(f"unix://{socket_path}", options=GRPC_OPTIONS)
    try:
        yield generate_pb2_grpc.TextGenerationServiceStub(channel)
    finally:
        channel.close()


def log_path(log_dir: Path, rank: int) -> Path:
    """Where rank `rank` of a ShardHandle writes its output."""
    return log_dir / f"rank-{rank}.log"


class ShardHandle:
    """Running shard processes (one per rank) serving one model on `{uds_path}-{rank}` sockets."""

    def __init__(self, uds_path: str, processes: list[subprocess.Popen | PreloadedProcess], log_dir: Path) -> None:
        self.uds_path = uds_path
        self.processes = processes
        self.log_dir = log_dir  # rank r logs to log_path(log_dir, r)
        self.sockets = [f"{uds_path}-{rank}" for rank in range(len(processes))]
        self.urls = [f"unix://{path}" for path in self.sockets]
        self._channels: list[grpc.Channel] = []

    @property
    def process(self) -> subprocess.Popen | PreloadedProcess:
        return self.processes[0]

    @property
    def socket(self) -> str:
        return self.sockets[0]

    @property
    def url(self) -> str:
        return self.urls[0]

    @property
    def log(self) -> str:
        return self.log_text(0)

    def log_text(self, rank: int = 0) -> str:
        try:
            return log_path(self.log_dir, rank).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stub(self, rank: int = 0) -> Any:
        from textgen_pb import generate_pb2_grpc

        channel = grpc.insecure_channel(self.urls[rank], options=GRPC_OPTIONS)
        self._channels.append(channel)
        return generate_pb2_grpc.TextGenerationServiceStub(channel)

    def wait_ready(self, timeout: float) -> None:
        """Poll Health on every rank until it answers; fail fast if a process exits."""
        from textgen_pb import generate_pb2

        deadline = time.monotonic() + timeout
        pending = list(range(len(self.processes)))
        while pending:
            for rank in list(pending):
                proc = self.processes[rank]
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"shard rank {rank} exited with {proc.returncode} before becoming ready:\n"
                        f"{self.log_text(rank)[-4000:]}"
                    )
                if os.path.exists(self.sockets[rank]):
                    with shard_stub(self.sockets[rank]) as stub:
                        try:
                            stub.Health(generate_pb2.HealthRequest(), timeout=2.0)
                            pending.remove(rank)
                        except grpc.RpcError:
                            pass
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"shard ranks {pending} not ready after {timeout}s:\n{self.log[-4000:]}")
            if pending:
                time.sleep(0.1)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every rank, SIGKILL what is left after `timeout`, close channels, remove logs and the socket
        files a killed rank leaves in /tmp."""
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for path in map(Path, self.sockets):
            path.unlink(missing_ok=True)
        shutil.rmtree(self.log_dir, ignore_errors=True)


def spawn_shards(
    model_dir: str | os.PathLike,
    uds_path: str | None = None,
    env: dict[str, str] | None = None,
    extra_args: Sequence[str] = (),
    num_shard: int = 1,
    timeout: float = 120.0,
) -> ShardHandle:
    """Start `num_shard` real `textgen-server serve` processes and wait until all answer Health."""
    uds_path = uds_path or unique_uds_path()
    log_dir = Path(tempfile.mkdtemp(prefix="tg-shard-logs-"))
    master_port = str(free_port())
    processes: list[subprocess.Popen | PreloadedProcess] = []
    try:
        for rank in range(num_shard):
            child_env = {k: v for k, v in os.environ.items() if k not in OUTPUT_VARS}
            child_env.update({"RANK": str(rank), "WORLD_SIZE": str(num_shard)})
            if num_shard > 1:
                child_env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master_port})
            child_env.update(env or {})
            cmd = [sys.executable, "-m", "textgen_server.cli", "serve", str(model_dir), "--uds-path", uds_path]
            if num_shard > 1:
                cmd.append("--sharded")
            cmd.extend(extra_args)
            processes.append(start_process(cmd, child_env, log_path(log_dir, rank)))
    except BaseException:  # a rank that cannot start (or `make test-fast` refusing it): the others and the logs go
        ShardHandle(uds_path, processes, log_dir).stop()
        raise
    handle = ShardHandle(uds_path, processes, log_dir)
    try:
        handle.wait_ready(timeout)
    except BaseException:
        handle.stop()
        raise
    return handle


class ShardProcess(contextlib.AbstractContextManager):
    """`with ShardProcess(model_dir, ...) as handle:` — spawn_shards, always stopped on exit."""

    def __init__(self, model_dir: str | os.PathLike, **kwargs: object) -> None:
        self.model_dir = model_dir
        self.kwargs = kwargs
        self.handle: ShardHandle | None = None

    def __enter__(self) -> ShardHandle:
        self.handle = spawn_shards(self.model_dir, **self.kwargs)  # type: ignore[arg-type]
        return self.handle

    def __exit__(self, *exc: object) -> None:
        if self.handle is not None:
            self.handle.stop()
