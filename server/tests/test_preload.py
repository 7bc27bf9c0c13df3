"""testing.preload: shards forked from a process that imported torch and transformers behave as exec'd ones, and a
shard whose environment those imports could have read is exec'd."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testing import preload
from testing.preload import PreloadedProcess, Preloader, PreloaderExited, preload_allowed, start_process
from testing.shards import spawn_shards, unique_uds_path

BASE = {"PATH": "/usr/bin", "HOME": "/root"}


def test_only_variables_read_after_import_may_differ() -> None:
    assert preload_allowed(BASE, BASE)
    assert preload_allowed({**BASE, "RANK": "1", "WORLD_SIZE": "2", "TEXTGEN_KV_CACHE_TOKENS": "64"}, BASE)
    assert preload_allowed({**BASE, "USE_FLASH_ATTENTION": "false", "PYTEST_CURRENT_TEST": "x"}, BASE)
    for name in ("HF_HOME", "ATEN_CPU_CAPABILITY", "OMP_WAIT_POLICY", "TRANSFORMERS_OFFLINE"):
        assert not preload_allowed({**BASE, name: "1"}, BASE), name
    assert not preload_allowed({"PATH": "/usr/bin"}, BASE)  # one removed counts too
    # The thread counts: the child sets both at once, so only both, equal, are applied.
    assert preload_allowed({**BASE, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, BASE)
    for threads in ({"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "2"}):
        assert not preload_allowed({**BASE, **threads}, BASE), threads
    assert not preload_allowed({**BASE, "OMP_NUM_THREADS": "0", "MKL_NUM_THREADS": "0"}, BASE)


def test_a_child_runs_on_the_threads_its_environment_gives(tmp_path: Path) -> None:
    """OpenMP read its count in the preloader: the child applies its own, as an exec'd process would have it."""
    show = [
        sys.executable,
        "-m",
        "timeit",
        "-n",
        "1",
        "-r",
        "1",
        "import torch; print('threads', torch.get_num_threads())",
    ]
    for threads in ("1", "3"):
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        code, log = exit_and_log(show, env, tmp_path, f"threads-{threads}.log")
        assert code == 0 and f"threads {threads}\n" in log, log


def exit_and_log(cmd: list[str], env: dict[str, str], tmp_path: Path, name: str) -> tuple[int, str]:
    process = start_process(cmd, env, tmp_path / name)
    assert isinstance(process, PreloadedProcess)
    return process.wait(timeout=120), (tmp_path / name).read_text()


def test_a_forked_shard_exits_with_the_cli_s_code_and_log(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "textgen_server.cli", "serve", str(tmp_path / "missing"), "--uds-path", "/tmp/x"]
    env = dict(os.environ)
    forked_code, forked_log = exit_and_log(cmd, env, tmp_path, "forked.log")
    with open(tmp_path / "exec.log", "wb") as log:
        execd = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=120)
    execd_log = (tmp_path / "exec.log").read_text()
    assert forked_code == execd.returncode == 1
    last = [log.strip().splitlines()[-1].split(" ", 2)[-1] for log in (forked_log, execd_log)]
    assert last[0] == last[1] and "missing" in last[0], (forked_log, execd_log)


def test_a_forked_shard_serves_and_reports_a_kill(tiny_llama: Path) -> None:
    handle = spawn_shards(tiny_llama)
    try:
        assert isinstance(handle.process, PreloadedProcess)
        assert handle.process.poll() is None
        handle.process.send_signal(signal.SIGKILL)
        assert handle.process.wait(timeout=30) == -signal.SIGKILL
    finally:
        handle.stop()


def test_an_environment_the_imports_read_gets_an_exec_d_shard(tiny_llama: Path, tmp_path: Path) -> None:
    handle = spawn_shards(tiny_llama, uds_path=unique_uds_path(), env={"HF_HOME": str(tmp_path)})
    try:
        assert isinstance(handle.process, subprocess.Popen)
    finally:
        handle.stop()
    assert handle.process.returncode == 0


def test_shards_are_exec_d_once_the_preloader_is_gone(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gone = Preloader(command=[sys.executable, "-c", "pass"])  # exits at once, as a failed import would
    while gone.alive():
        time.sleep(0.05)
    with pytest.raises(PreloaderExited):
        gone.start(
            [sys.executable, "-m", "textgen_server.cli", "serve", str(tiny_llama)], dict(os.environ), "/dev/null"
        )
    monkeypatch.setattr(preload, "_preloader", gone)
    handle = spawn_shards(tiny_llama)
    try:
        assert isinstance(handle.process, subprocess.Popen)
    finally:
        handle.stop()


def test_signalling_a_child_reaped_before_its_exit_report_arrives_is_not_an_error() -> None:
    """Between the preloader reaping a child that exited and the test process reading its report, the pid is gone
    while `returncode` is still None: stopping it then (a failed start's other ranks) must pass, as `Popen`'s."""
    reporter = Preloader(command=[sys.executable, "-c", "pass"])  # a preloader that will report no exit
    reaped = subprocess.Popen([sys.executable, "-c", "pass"])
    reaped.wait(timeout=60)
    child = PreloadedProcess(reporter, reaped.pid, [sys.executable, "-c", "pass"])
    assert child.returncode is None
    child.terminate()
    child.kill()
