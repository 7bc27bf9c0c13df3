"""Shard and router processes forked from a process that has already imported torch and transformers.

A `textgen-server serve` start spends about 5 s of CPU importing torch and transformers (transformers' model
loading and `torch.distributed.tensor` come with its config classes) before it reads a weight, and a router
imports transformers too (its chat template renderer; all of it where it builds a tokenizer not yet kept); the
suite starts about 70 shards through `testing.shards` and a dozen routers through the router tests'
`RouterProcess`, on two cores. A `Preloader` is one process per test process that imports those packages once
and forks a child per start (`start_process`): the child runs the real entry point (`python -m
textgen_server.cli` or `textgen_router.main`: argument parsing, the model or tokenizer load, the server on its
socket, the exit code) in a process of its own, and a tiny shard is ready in under a second (benchmark/README.md,
"Start-up and the test suite").

What differs from an exec'd process is only what the preloaded modules did at import, so a child is forked only
when its environment differs from the preloader's in variables that torch and transformers read later, if ever
(`RUNTIME_VARIABLES`: textgen's own and torch.distributed's; `THREAD_VARIABLES`, which the child applies); any
other difference (HF_HOME, ATEN_CPU_CAPABILITY, OMP_WAIT_POLICY, ...) gets an exec'd process. Nothing of textgen is
imported before the fork. `TEXTGEN_TEST_PRELOAD=0` turns forking off for a run. The launcher's tests start shards
and routers as users do: the launcher execs them.

The wire, one JSON object per line: the test process writes `{"argv", "env", "cwd", "log"}` to the preloader's
stdin; the preloader answers `{"pid"}` for each, and `{"exited", "code"}` when a child exits (it is the child's
parent, so only it can read the exit status; the code is `Popen.returncode`'s, negative for a signal).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

SWITCH = "TEXTGEN_TEST_PRELOAD"
RUNTIME_VARIABLES = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "USE_FLASH_ATTENTION",
        "PREFIX_CACHING",
        "ATTENTION",
        "REQUEST_LOGPROBS",
        "ROPE_SCALING",
        "ROPE_FACTOR",
        "LORA_ADAPTERS",
        "DISABLE_CUSTOM_KERNELS",
        "MAX_BATCH_SIZE",
        "TGI_WIGGLE_ROOM",
        "PYTEST_CURRENT_TEST",
        # torch sets it in a test process that compiled something, and reads it when a cache is first used
        "TORCHINDUCTOR_CACHE_DIR",
    }
)
RUNTIME_PREFIXES = ("TEXTGEN_", "OTEL_")  # textgen's own; opentelemetry is not preloaded
# OpenMP and MKL read their thread counts when torch loads them, in the preloader; a child given both, equal, sets
# them as torch.set_num_threads does (both libraries at once) before it runs anything: a benchmark's pinned shard.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def preload_allowed(env: Mapping[str, str], base: Mapping[str, str]) -> bool:
    """Whether a child with `env` may be forked from a preloader started with `base`."""
    changed = {key for key in env.keys() | base.keys() if env.get(key) != base.get(key)}
    if changed & set(THREAD_VARIABLES) and _thread_count(env) is None:
        return False
    return all(
        key in RUNTIME_VARIABLES or key in THREAD_VARIABLES or key.startswith(RUNTIME_PREFIXES) for key in changed
    )


def _thread_count(env: Mapping[str, str]) -> int | None:
    """The count both THREAD_VARIABLES give, or None where they are not one positive number."""
    values = {env.get(key, "") for key in THREAD_VARIABLES}
    value = values.pop()
    return int(value) if not values and value.isdigit() and int(value) > 0 else None


class PreloaderExited(RuntimeError):
    """The preloader is gone (it failed at start, e.g. a kernel without pidfd_open): processes are exec'd instead."""


class PreloadedProcess:
    """A forked shard or router, with the part of `subprocess.Popen`'s interface the tests use."""

    def __init__(self, preloader: Preloader, pid: int, args: Sequence[str]) -> None:
        self._preloader = preloader
        self.pid = pid
        self.args = list(args)

    @property
    def returncode(self) -> int | None:
        return self._preloader.exit_code(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._preloader.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            # The preloader, its parent, may have reaped it already while its exit report is still on the way:
            # then it is gone, as `Popen.send_signal` treats a process that died before the signal.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Preloader:
    """The test process's side: starts the preloader, sends it starts, and keeps the exit codes it reports."""

    def __init__(self, command: Sequence[str] = (sys.executable, "-m", "testing.preload")) -> None:
        self.env = dict(os.environ)
        self._process = subprocess.Popen(
            list(command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
            text=True,
            bufsize=1,
        )
        self._lock = threading.Condition()
        self._pids: list[int] = []
        self._exits: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, name="preload-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            message = json.loads(line)
            with self._lock:
                if "exited" in message:
                    self._exits[message["exited"]] = message["code"]
                else:
                    self._pids.append(message["pid"])
                self._lock.notify_all()
        with self._lock:
            self._pids.append(-1)  # the preloader is gone: a start waiting on it fails
            self._lock.notify_all()

    def alive(self) -> bool:
        return self._process.poll() is None

    def start(self, argv: Sequence[str], env: Mapping[str, str], log_path: str) -> PreloadedProcess:
        """Fork a child that runs `argv` (`python -m MODULE ARGS`) with `env`, its stdout and stderr going to
        `log_path`."""
        request = {"argv": list(argv), "env": dict(env), "cwd": os.getcwd(), "log": log_path}
        with self._lock:
            assert self._process.stdin is not None
            try:
                self._process.stdin.write(json.dumps(request) + "\n")
                self._process.stdin.flush()
            except OSError as error:  # a closed pipe
                raise PreloaderExited("the preloader exited") from error
            if not self._lock.wait_for(lambda: self._pids, timeout=60):
                raise RuntimeError("the preloader did not answer a start within 60 s")
            pid = self._pids.pop(0)
        if pid < 0:
            raise PreloaderExited("the preloader exited")
        return PreloadedProcess(self, pid, argv)

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._lock:
            self._lock.wait_for(lambda: pid in self._exits, timeout=timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        """End of input: the preloader exits; children still running are the fixtures' to stop."""
        if self._process.stdin is not None:
            with contextlib.suppress(OSError):  # a preloader already gone leaves a broken pipe
                self._process.stdin.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()


_preloader: Preloader | None = None


def preloader() -> Preloader | None:
    """The test process's preloader, started at its first use; None when TEXTGEN_TEST_PRELOAD=0 or once it has
    exited (it is not restarted: what stopped it would stop the next one)."""
    global _preloader
    if os.environ.get(SWITCH, "1") == "0":
        return None
    if _preloader is None:
        _preloader = Preloader()
        atexit.register(_preloader.close)
    return _preloader if _preloader.alive() else None


def start_process(cmd: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen | PreloadedProcess:
    """`cmd` (`python -m MODULE ARGS`) with `env`, stdout and stderr to `log_path`: forked from the test process's
    preloader where its environment allows, else exec'd."""
    starter = preloader()
    if starter is not None and preload_allowed(env, starter.env):
        log_path.touch()
        try:
            return starter.start(cmd, env, str(log_path))
        except PreloaderExited as gone:
            print(f"{gone}: the process is exec'd", file=sys.stderr)
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)


def _run_child(request: dict, closing: Sequence[int]) -> None:
    """In the forked child: the shard's own descriptors, environment, arguments; the CLI's exit becomes the
    process's, after the atexit handlers as at an interpreter's normal exit."""
    import runpy
    import traceback

    for fd in closing:
        os.close(fd)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    threads = _thread_count(os.environ)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    argv = request["argv"]
    module = argv[argv.index("-m") + 1]
    sys.argv = [module, *argv[argv.index("-m") + 2 :]]
    code = 1
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:  # as the interpreter exits: None is 0, a message is printed and is 1
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            threading._shutdown()  # type: ignore[attr-defined]  # what a normal exit waits for
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    """The preloader: imports, then forks a child per request line until its stdin ends."""
    import selectors

    # What every shard imports before it reads a weight: torch, and transformers with its config and tokenizer
    # classes, its model loading (through the config's validators) and the pieces the models use.
    import torch  # noqa: F401
    from transformers import (  # noqa: F401
        AutoConfig,
        AutoTokenizer,
        PreTrainedTokenizerFast,
        activations,
        cache_utils,
        modeling_rope_utils,
    )

    children: dict[int, int] = {}  # pidfd -> pid
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)

    def say(message: dict) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fd == 0:
                data = os.read(0, 1 << 20)
                if not data:
                    return
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    request = json.loads(line)
                    pid = os.fork()
                    if pid == 0:
                        selector.close()
                        _run_child(request, list(children))
                    pidfd = os.pidfd_open(pid)
                    children[pidfd] = pid
                    selector.register(pidfd, selectors.EVENT_READ)
                    say({"pid": pid})
            else:
                pidfd = key.fd
                selector.unregister(pidfd)
                pid = children.pop(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
