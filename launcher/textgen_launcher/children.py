"""Child processes of the launcher: spawned in their own process group, output pumped by threads,
stopped with SIGTERM then SIGKILL.

Own process group: a Ctrl-C in the terminal reaches only the launcher, which then stops the children in
order (router first, shards after). PR_SET_PDEATHSIG: if the launcher itself is killed with SIGKILL,
the kernel still delivers SIGTERM to every child, so nothing is left behind.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

logger = logging.getLogger("textgen_launcher")
PR_SET_PDEATHSIG = 1
STDERR_TAIL_LINES = 400


# Resolved before any fork: looking a symbol up inside a forked child of a threaded process can deadlock.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    # The signal fires when the forking *thread* ends: children are only ever spawned from the main thread.
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


class Child:
    """One running child. `on_stdout` gets each stdout line; stderr is kept (last lines) and optionally echoed.

    With `stdin_pipe`, the launcher keeps the write end of the child's stdin (`send_line`); otherwise the child's
    stdin is /dev/null.
    """

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        env: dict[str, str],
        on_stdout: Callable[[str], None],
        echo_stderr: bool,
        stdin_pipe: bool = False,
    ) -> None:
        self.name = name
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.process = subprocess.Popen(
            list(cmd),
            env=env,
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            bufsize=1,
            process_group=0,
            preexec_fn=_die_with_parent,
        )
        self._threads = [
            threading.Thread(target=self._pump, args=(self.process.stdout, on_stdout), daemon=True),
            threading.Thread(
                target=self._pump, args=(self.process.stderr, self._stderr_line(echo_stderr)), daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()

    def _stderr_line(self, echo: bool) -> Callable[[str], None]:
        def keep(line: str) -> None:
            self.stderr_tail.append(line)
            if echo:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()

        return keep

    @staticmethod
    def _pump(stream: IO[str] | None, sink: Callable[[str], None]) -> None:
        assert stream is not None
        for line in stream:
            sink(line.rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def send_line(self, line: str) -> None:
        """Writes one line to the child's stdin (a `stdin_pipe` child) and closes it: a child that reads stdin
        to its end learns that nothing more comes."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(line + "\n")
            self.process.stdin.close()
        except BrokenPipeError:  # the child already exited; its exit is what the caller's monitor reports
            pass

    def drain(self, timeout: float = 5.0) -> None:
        """Waits for the output threads to reach end of stream (after the process exited)."""
        for thread in self._threads:
            thread.join(timeout)

    def stderr_text(self) -> str:
        return "\n".join(self.stderr_tail)

    def kill_strays(self) -> None:
        try:
            # Grandchildren share the group; once the leader is gone only strays can receive this.
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def stop_all(children: Sequence[Child], timeout: float) -> None:
    """SIGTERM to every running child at once, up to `timeout` seconds of grace, then SIGKILL (TGI's
    `terminate`, run for all of them together)."""
    running = [c for c in children if c.poll() is None]
    for child in running:
        logger.info("Terminating %s", child.name)
        child.process.send_signal(signal.SIGTERM)
        logger.info("Waiting for %s to gracefully shutdown", child.name)
    deadline = time.monotonic() + timeout
    for child in running:
        try:
            child.process.wait(max(deadline - time.monotonic(), 0.0))
            logger.info("%s terminated", child.name)
        except subprocess.TimeoutExpired:
            logger.info("Killing %s", child.name)
            child.process.kill()
            child.process.wait()
            logger.info("%s killed", child.name)
    for child in children:
        child.kill_strays()
        child.drain()
