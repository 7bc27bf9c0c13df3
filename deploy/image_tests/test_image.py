"""The container image run as the README says (`make image-test`, after `make image`; minutes, so not part of
`make test`): a model built into a `/data` volume by the image itself, a container on that volume answering
every route a client and Prometheus use, `stop` (SIGTERM) draining a running stream before the container exits 0,
and a second container on the same volume reusing the CPU ops and kernel timings the first one built (no rebuild:
a shorter start). The containers get HOSTNAME as Docker sets it (a short id, not an address) and the memory limit
of deploy/kubernetes; the shard sizes its KV pool under that limit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest

from deploy.image import DEFAULT_TAG, engine, rlimit_flags
from deploy.image_tests.container import Container, engine_run
from textgen_common.ports import free_port

IMAGE = os.environ.get("IMAGE", DEFAULT_TAG)
MODEL = "/data/models/tiny-llama"
MEMORY_LIMIT = "4g"  # deploy/kubernetes/deployment.yaml's limit
STREAM_TOKENS = 400
FIGURES: dict[str, str] = {}


@pytest.fixture(scope="module")
def tool() -> str:
    name = engine()
    engine_run(name, "image", "inspect", IMAGE)  # `make image-test` builds it first
    size = int(engine_run(name, "image", "inspect", "--format", "{{.Size}}", IMAGE))
    FIGURES["image"] = f"{IMAGE}, {size / 1e9:.2f} GB ({name})"
    return name


@pytest.fixture(scope="module")
def data(tool: str) -> Iterator[Path]:
    """A fresh /data volume holding a model the image's own `textgen-server build-test-model` made."""
    path = Path(tempfile.mkdtemp(prefix="textgen-image-data-"))
    start = time.monotonic()
    engine_run(
        tool, "run", "--rm", "--network", "host", *rlimit_flags(tool, IMAGE), "-v", f"{path}:/data",
        "--entrypoint", "textgen-server", IMAGE,
        "build-test-model", MODEL, "--arch", "llama", "--size", "tiny",
    )  # fmt: skip
    FIGURES["model built in the volume"] = f"{time.monotonic() - start:.1f} s"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def first(tool: str, data: Path) -> Iterator[Container]:
    container = Container(tool, IMAGE, data, free_port(), ["--model-id", MODEL], memory=MEMORY_LIMIT)
    try:
        FIGURES["first start to healthy"] = f"{container.wait_healthy():.1f} s"
        yield container
    finally:
        container.remove()


def built_files(data: Path) -> dict[str, float]:
    """The CPU ops and kernel timings a start leaves in the volume, with their modification times."""
    found = {}
    for folder in ("torch_extensions", "textgen"):
        for path in (data / folder).rglob("*"):
            if path.is_file():
                found[str(path.relative_to(data))] = path.stat().st_mtime
    return found


def test_every_route_answers(first: Container) -> None:
    url = first.base_url
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    info = httpx.get(f"{url}/info", timeout=10).json()
    assert info["model_id"] == MODEL
    body = {"inputs": "Hello world", "parameters": {"max_new_tokens": 8, "details": True}}
    generated = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    assert generated["details"]["generated_tokens"] == 8 and generated["generated_text"]
    events = stream(url, 8)
    assert len(events) == 8 and events[-1]["generated_text"] == generated["generated_text"]
    chat = {"model": "tgi", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}
    completion = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).json()
    assert completion["choices"][0]["message"]["role"] == "assistant"
    assert completion["usage"]["completion_tokens"] == 5
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert re.search(r"^tgi_request_success \d+", metrics, re.M) and "tgi_queue_size" in metrics


def test_hostname_as_docker_sets_it(first: Container) -> None:
    # Docker and podman set HOSTNAME to the container's short id; the launcher reads HOSTNAME as its --hostname,
    # and a value that is not an address means 0.0.0.0, so the published port reaches the router.
    launcher_env = first.exec("cat", "/proc/1/environ").split("\0")
    assert f"HOSTNAME={first.inspect('{{.Id}}')[:12]}" in launcher_env
    assert httpx.get(f"{first.base_url}/health", timeout=10).status_code == 200


def test_the_kv_pool_fits_the_memory_limit(first: Container) -> None:
    logs = first.logs()
    match = re.search(r"KV pool on cpu: (\d+) blocks of \d+ tokens, ([\d.]+) GiB \(([\d.]+) GiB of free memory", logs)
    assert match, logs[-3000:]
    FIGURES[f"KV pool under --memory {MEMORY_LIMIT}"] = f"{match.group(2)} GiB ({match.group(3)} GiB allowed)"
    # 0.95 of what the limit leaves after the weights and the processes, not of the host's free memory
    assert float(match.group(2)) <= float(match.group(3)) < 4.0


def stream(url: str, tokens: int, on_event: object = None) -> list[dict]:
    body = {"inputs": "Hello world", "parameters": {"max_new_tokens": tokens, "details": True}}
    events = []
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:") :]))
                if callable(on_event):
                    on_event(len(events))
    return events


def test_stop_drains_a_running_stream_and_exits_0(first: Container, data: Path) -> None:
    FIGURES["ops and timings built by the first start"] = f"{len(built_files(data))} files"
    stopping: dict[str, object] = {}

    def stop() -> None:
        stopping["exit_code"] = first.stop(timeout=60)
        stopping["returned"] = time.monotonic()

    stopper = threading.Thread(target=stop)

    def on_event(count: int) -> None:
        if count == 1:  # the request is in flight: stop the container under it
            stopping["at"] = time.monotonic()
            stopper.start()

    events = stream(first.base_url, STREAM_TOKENS, on_event)
    last_event, last_event_utc = time.monotonic(), datetime.now(timezone.utc)
    stopper.join(timeout=120)
    final = events[-1]
    assert final["details"]["finish_reason"] == "length"
    assert len(events) == final["details"]["generated_tokens"] == STREAM_TOKENS
    # the launcher (PID 1) had the SIGTERM while the stream ran, and the container exited only after it ended
    logs = first.logs()
    received = re.search(r"^(\S+ \S+) INFO textgen_launcher\S*: Received SIGTERM$", logs, re.M)
    assert received, logs[-3000:]
    received_utc = datetime.strptime(received.group(1), "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=timezone.utc)
    assert received_utc < last_event_utc
    assert stopping["exit_code"] == 0
    assert stopping["returned"] >= last_event  # type: ignore[operator]
    assert logs.index("Terminating webserver") < logs.index("Terminating shard 0")
    drained = (last_event_utc - received_utc).total_seconds()
    FIGURES["stop with a stream in flight"] = f"exit 0, {STREAM_TOKENS} tokens, the last {drained:.1f} s after SIGTERM"


def test_a_second_container_reuses_the_volume(tool: str, data: Path, first: Container) -> None:
    built = built_files(data)
    assert any(name.startswith("torch_extensions/") and name.endswith(".so") for name in built), built
    assert not first.running()
    second = Container(tool, IMAGE, data, free_port(), ["--model-id", MODEL], memory=MEMORY_LIMIT)
    try:
        healthy = second.wait_healthy()
        FIGURES["second start to healthy"] = f"{healthy:.1f} s"
        body = {"inputs": "Hello world", "parameters": {"max_new_tokens": 8}}
        assert httpx.post(f"{second.base_url}/generate", json=body, timeout=60).status_code == 200
        assert built_files(data) == built  # nothing rebuilt or re-measured
        first_healthy = float(FIGURES["first start to healthy"].split()[0])
        assert healthy < first_healthy
        assert second.stop(timeout=60) == 0
    finally:
        second.remove()
    print("\nimage test figures:\n" + "\n".join(f"  {key}: {value}" for key, value in FIGURES.items()))
