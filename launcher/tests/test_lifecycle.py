"""The real launcher end to end with the tiny model: start, serve, stop on SIGTERM with a request in
flight, die when a shard dies, refuse a taken port, fail clearly on a missing model."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from testing.launcher import LauncherProcess, run_launcher
from textgen_common.ports import free_port

LaunchFactory = Callable[..., LauncherProcess]


@pytest.fixture
def launch(launcher: Callable[..., LauncherProcess]) -> Iterator[LaunchFactory]:
    """The session's launcher factory, not waiting for health, and every launcher stopped with its test."""
    started: list[LauncherProcess] = []

    def start(model: Path, *args: str, env: dict[str, str] | None = None) -> LauncherProcess:
        started.append(launcher(model, *args, env=env, wait=False))
        return started[-1]

    yield start
    for launched in started:
        launched.stop()


def test_sigterm_lets_the_request_in_flight_finish(launch: LaunchFactory, tiny_llama: Path) -> None:
    # --disable-custom-kernels rides on this launch (one shard start less for the suite): it changes which ops
    # compute the tokens, not the lifecycle this test follows.
    launched = launch(tiny_llama, "--graceful-termination-timeout", "30", "--disable-custom-kernels")
    print(f"launch to healthy: {launched.wait_healthy():.1f}s")
    log = launched.log
    assert "Shard 0 ready in" in log and "Starting Webserver" in log
    assert log.index("Shard 0 ready in") < log.index("Starting Webserver")
    # The router was started with the shard, not once it was ready: its imports and tokenizer overlap the load.
    router, shard = (next(p for p in launched.known if name in " ".join(p.cmdline())) for name in ("router", "serve"))
    ready_s = float(log.split("Shard 0 ready in ")[1].split("s")[0])
    assert router.create_time() - shard.create_time() < ready_s / 2, (router.create_time(), shard.create_time())
    # The shard ran none of textgen's kernels: no measured linear choice, no C++ ops' library loaded.
    assert "[shard 0] CPU linear: F.linear everywhere (DISABLE_CUSTOM_KERNELS)" in log and " rows 1: " not in log
    (shard,) = launched.shard_pids()
    assert "textgen_cpu_ops_" not in Path(f"/proc/{shard}/maps").read_text()
    # A second launcher on the same sockets must not take them over.
    second = run_launcher(["--model-id", str(tiny_llama), "--shard-uds-path", launched.uds, "--port", str(free_port())])
    assert second.returncode == 1
    assert f"{launched.uds}-0 is the socket of a running shard; choose another --shard-uds-path" in second.stderr
    body = {"inputs": "Hello world", "parameters": {"max_new_tokens": 40, "details": True}}
    events = []
    with httpx.stream("POST", f"{launched.base_url}/generate_stream", json=body, timeout=60.0) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            events.append(json.loads(line[len("data:") :]))
            if len(events) == 1:  # the request is now in flight: stop the launcher under it
                launched.process.send_signal(signal.SIGTERM)
    final = events[-1]
    assert final["details"]["finish_reason"] == "length"
    assert final["details"]["generated_tokens"] == 40 == len(events)
    assert launched.wait_exit(60) == 0
    assert launched.survivors() == []
    assert launched.sockets_left() == []
    log = launched.log
    assert log.index("Terminating webserver") < log.index("Terminating shard 0")


def test_a_dead_shard_stops_everything(launch: LaunchFactory, tiny_llama: Path) -> None:
    launched = launch(tiny_llama, "--num-shard", "2", "--json-output")
    launched.wait_healthy()
    shards = launched.shard_pids()
    assert len(shards) == 2
    os.kill(shards[1], signal.SIGKILL)
    killed_at = time.monotonic()
    assert launched.wait_exit(30) == 1
    assert time.monotonic() - killed_at < 15
    assert launched.survivors() == []
    assert launched.sockets_left() == []
    records = [json.loads(line) for line in launched.log.splitlines() if line.startswith("{")]
    assert any(r["message"] == "Shard 1 crashed" and r["level"] == "ERROR" for r in records)
    assert any(r["target"] == "textgen_launcher" and r["message"].startswith("Shard 1 ready in") for r in records)
    # Shard lines come back with the shard's rank.
    assert {r["fields"]["rank"] for r in records if "rank" in r.get("fields", {})} == {0, 1}
    assert "Error: ShardFailed" in launched.log


def test_a_router_that_fails_stops_the_shards(launch: LaunchFactory, tiny_llama: Path) -> None:
    # Only the router learns it, at warmup: the shards' KV pool (capped to 128 tokens) cannot hold the warmup
    # batch of --max-total-tokens requests.
    launched = launch(
        tiny_llama, "--max-input-tokens", "100", "--max-total-tokens", "200", env={"TEXTGEN_KV_CACHE_TOKENS": "128"}
    )
    assert launched.wait_exit(240) == 1
    log = launched.log
    assert (
        "Unable to warmup the Python model shards: Server error: Not enough memory to handle 2048 prefill tokens. "
        "You need to decrease `--max-batch-prefill-tokens`" in log
    )
    assert "Webserver Crashed" in log and "Error: WebserverFailed" in log
    assert log.index("Webserver Crashed") < log.index("Terminating shard 0")
    assert launched.sockets_left() == []
    assert not any(
        "serve" in " ".join(p.cmdline()) and launched.uds in " ".join(p.cmdline())
        for p in psutil.process_iter()
        if p.pid != os.getpid() and _alive(p)
    )


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_shard_that_cannot_start_is_reported(launch: LaunchFactory, tiny_llama: Path) -> None:
    launched = launch(tiny_llama, "--quantize", "exl2")  # exllama kernels: CUDA only, refused by CPU shards
    assert launched.wait_exit(120) == 1
    log = launched.log
    assert "[shard 0] --quantize exl2 is not supported" in log
    assert "Shard 0 failed to start" in log and "Error: ShardCannotStart" in log
    assert "Starting Webserver" not in log and launched.sockets_left() == []


def test_a_killed_launcher_takes_its_shards_along(launch: LaunchFactory, tiny_llama: Path) -> None:
    launched = launch(tiny_llama, "--num-shard", "2")
    deadline = time.monotonic() + 60
    while len(launched.shard_pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
        launched.remember_children()
    assert len(launched.shard_pids()) == 2, launched.log
    os.kill(launched.process.pid, signal.SIGKILL)  # no chance to clean up: the kernel must tell the children
    launched.wait_exit(10)
    deadline = time.monotonic() + 30
    while launched.survivors() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert launched.survivors() == []


def test_port_in_use_stops_before_anything_starts(tiny_llama: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_launcher(["--model-id", str(tiny_llama), "--hostname", "127.0.0.1", "--port", str(port)])
    assert result.returncode == 1
    assert f'Error: PortInUse("Port 127.0.0.1:{port} is not available: Address already in use")' in result.stderr
    assert "Starting" not in result.stdout


@pytest.mark.parametrize("model_id", ["/tmp/no-such-model-dir", "no-such-org/no-such-model"])
def test_missing_model_is_one_clear_line(model_id: str) -> None:
    result = run_launcher(["--model-id", model_id, "--port", str(free_port())])
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    errors = [line for line in output.splitlines() if "Download encountered an error" in line]
    assert len(errors) == 1 and model_id in errors[0], output
    assert "Traceback" not in output
    assert "Error: DownloadError" in result.stderr
