"""The gate in front of the router (textgen_common.router_gate), with real child processes: the launcher
watches the router while the shards load, and the router waits for the launcher's word before it connects."""

from __future__ import annotations

import logging
import sys

import pytest

from textgen_launcher.children import Child, stop_all
from textgen_launcher.errors import WebserverFailed
from textgen_launcher.shards import Shard, wait_ready

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_router_that_exits_while_the_shards_load_stops_the_wait(caplog: pytest.LogCaptureFixture) -> None:
    loading = Shard(0, "/tmp/tg-gate-never-0", Child("shard 0", SLEEPER, {}, print, echo_stderr=False))
    router = Child("webserver", [sys.executable, "-c", "raise SystemExit(1)"], {}, print, echo_stderr=False)
    try:
        with caplog.at_level(logging.INFO, "textgen_launcher"), pytest.raises(WebserverFailed):
            wait_ready([loading], lambda: True, router)
        assert "Webserver Crashed" in caplog.messages
        assert loading.child.poll() is None  # stopping the shards is the caller's part (serve's finally)
    finally:
        stop_all([router, loading.child], timeout=5)


def test_the_launcher_line_reaches_a_child_that_reads_stdin() -> None:
    echo = [sys.executable, "-c", "import sys; print(repr(sys.stdin.readline()), repr(sys.stdin.readline()))"]
    lines: list[str] = []
    child = Child("webserver", echo, {}, lines.append, echo_stderr=False, stdin_pipe=True)
    child.send_line("shards-ready")
    assert child.process.wait(30) == 0
    child.drain()
    assert lines == ["'shards-ready\\n' ''"]  # the line, then end of file: nothing more comes
