"""The pytest fixtures every test directory shares; the repo-root conftest.py registers this module once.

Models (session-scoped, from testing.models' on-disk cache): `tiny_llama`, `tiny_gpt2`, `tiny_mistral`,
`tiny_qwen2`: the `Path` of a tiny real model of that architecture; `cycling_llama`: the tiny llama made to loop
(`textgen_server.builder.build_cycling_model`), for speculation.

Real shard processes (testing.shards):
- `start_shard(model_dir, uds_path=None, env=None, extra_args=(), num_shard=1, timeout=120.0)`:
  function-scoped factory around `spawn_shards`; every shard it started is stopped at the end of the test.
  Module- and session-scoped fixtures use `testing.shards.ShardProcess` directly.

Real launchers (testing.launcher):
- `launcher(model_dir, *args, env=None, wait=True)`: session-scoped factory. Starts `textgen-launcher` on a
  free loopback port with `args` appended (its own process group, a short unique --shard-uds-path), waits for
  GET /health (bounded; its log is printed and it is stopped if that fails) unless `wait=False`, and returns a
  `LauncherProcess` (`.base_url`, `.model_dir`, `.process`, `.log`, `.uds`, `.wait_healthy()`, `.wait_exit()`,
  `.shard_pids()`, `.survivors()`, `.sockets_left()`, `.stop()`). Whatever is still running at the end of the
  session is stopped (process group killed, no socket left); narrower scopes call `.stop()` themselves.
- `llama_server`: the tiny llama behind one launcher with `--enable-prefill-logprobs` (so `decoder_input_details`
  returns the prompt's logprobs, off by default on the paged engine as in TGI 3), shared by the whole session
  (integration and client tests); `llama_client` / `llama_async_client`: textgen_client clients on it.
"""

from __future__ import annotations

import multiprocessing.process
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from testing.launcher import LauncherProcess
from testing.models import build_model
from testing.shards import ShardHandle, spawn_shards
from textgen_common import cache_dir

if TYPE_CHECKING:  # the client package is imported only by sessions that use it
    from textgen_client import AsyncClient, Client


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--no-processes",
        action="store_true",
        help="skip each test at the moment it would start a process (`make test-fast`, the edit-test loop)",
    )


def pytest_configure(config: pytest.Config) -> None:
    _use_session_measurements()
    if "PYTEST_XDIST_WORKER" in os.environ:
        _one_thread_per_worker()
    else:
        _passive_openmp()


def _passive_openmp() -> None:
    """OMP_WAIT_POLICY=PASSIVE for every process of the session (unless the shell sets it): an OpenMP thread
    with no work sleeps at once instead of spinning first, on two cores that two workers and their shards share.
    It changes no result, only how long a parallel region's threads take to wake: make test went from 586 to 530 s
    on the Zen 3 (benchmark/README.md, "Start-up and the test suite"). Set before the workers start and before any
    torch import, since OpenMP reads it when its library loads; pytest-xdist's workers and every process a test
    starts inherit it."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _one_thread_per_worker() -> None:
    """A pytest-xdist worker runs its own torch work (oracles, op tests) on one thread. The workers share the cores
    with each other and with the shards they start; with torch's default of a thread per core, idle OpenMP
    threads spin on cores another process needs: `make test-fast` in two workers took 2.1x the CPU of a serial
    run (benchmark/README.md, "Start-up and the test suite"). Shards and scripts keep their own threads."""
    import torch

    torch.set_num_threads(1)


def _refuse_processes(self: object, *args: object, **kwargs: object) -> None:
    pytest.skip("starts a process: `make test` runs it, `make test-fast` does not")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With --no-processes, a test (its fixtures included) that starts a process is skipped at that moment.

    Every process a test starts goes through subprocess.Popen (a shard, a router, a launcher, a script, a
    compiler) or multiprocessing's Process.start (tensor-parallel ranks, the router's tokenization workers):
    refused there, whatever helper or fixture asked, so no list of slow tests needs keeping. Skipped is no
    Exception: no `except Exception` on the way swallows it. Only while tests run: plugins may start processes
    while pytest sets up."""
    if not item.config.getoption("no_processes"):
        yield
        return
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start
    subprocess.Popen.__init__ = _refuse_processes  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = _refuse_processes  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.__init__ = popen_init  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start = process_start  # type: ignore[method-assign]


def _use_session_measurements() -> None:
    """One TEXTGEN_CACHE_DIR (textgen_common/cache_dir.py) for the session's processes, new each session: every
    shard it starts reads the CPU kernel timings the first one of a shape measured, every router the tokenizer the
    first one built, and no run depends on what an earlier one (or a developer's own servers) left in ~/.cache.
    pytest-xdist's workers inherit the controller's."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        os.environ[cache_dir.ENV] = tempfile.mkdtemp(prefix="textgen-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        shutil.rmtree(os.environ.pop(cache_dir.ENV, ""), ignore_errors=True)


def tiny_model_fixture(arch: str) -> Callable[[], Path]:
    """A session fixture `tiny_<arch>`: the tiny model of that architecture, from the on-disk cache."""

    @pytest.fixture(scope="session", name=f"tiny_{arch}")
    def tiny_model() -> Path:
        return build_model(arch, "tiny")

    return tiny_model


tiny_llama = tiny_model_fixture("llama")
tiny_gpt2 = tiny_model_fixture("gpt2")
tiny_mistral = tiny_model_fixture("mistral")
tiny_qwen2 = tiny_model_fixture("qwen2")


@pytest.fixture(scope="session")
def cycling_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from textgen_server.builder import build_cycling_model

    return build_cycling_model(tiny_llama, tmp_path_factory.mktemp("cycling") / "llama")


@pytest.fixture
def start_shard() -> Iterator[Callable[..., ShardHandle]]:
    """Factory: `start_shard(model_dir, uds_path=None, env=None, extra_args=(), num_shard=1)`."""
    handles: list[ShardHandle] = []

    def start(model_dir: str | os.PathLike, **kwargs: object) -> ShardHandle:
        handle = spawn_shards(model_dir, **kwargs)  # type: ignore[arg-type]
        handles.append(handle)
        return handle

    yield start
    for handle in handles:
        handle.stop()


@pytest.fixture(scope="session")
def launcher() -> Iterator[Callable[..., LauncherProcess]]:
    """Factory: `launcher(model_dir, *args, env=None, wait=True) -> LauncherProcess` (see the module docstring)."""
    started: list[LauncherProcess] = []

    def start(
        model_dir: str | os.PathLike, *args: str, env: dict[str, str] | None = None, wait: bool = True
    ) -> LauncherProcess:
        handle = LauncherProcess(model_dir, args, env)
        started.append(handle)
        if wait:
            try:
                handle.wait_healthy()
            except BaseException:
                print(handle.log, file=sys.stderr)
                handle.stop()
                raise
        return handle

    yield start
    for handle in started:
        handle.stop()


@pytest.fixture(scope="session")
def llama_server(launcher: Callable[..., LauncherProcess], tiny_llama: Path) -> LauncherProcess:
    """The tiny llama behind one `textgen-launcher --enable-prefill-logprobs`, for every test directory of the
    session."""
    return launcher(tiny_llama, "--enable-prefill-logprobs")


@pytest.fixture(scope="session")
def llama_client(llama_server: LauncherProcess) -> Client:
    from textgen_client import Client

    return Client(llama_server.base_url, timeout=60)


@pytest.fixture(scope="session")
def llama_async_client(llama_server: LauncherProcess) -> AsyncClient:
    from textgen_client import AsyncClient

    return AsyncClient(llama_server.base_url, timeout=120)
