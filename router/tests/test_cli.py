"""`textgen-router` arguments (flags, env vars, precedence), start-up failures and graceful shutdown of the real
binary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_fixtures import RouterProcess

from testing.shards import ShardProcess
from textgen_common import router_gate
from textgen_common.addresses import listen_address
from textgen_common.ports import free_port
from textgen_router.args import parse_args
from textgen_router.main import log_level

pytestmark = pytest.mark.timeout(120)


def test_defaults_are_tgi_router_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HOSTNAME", "PORT", "MAX_BATCH_SIZE", "JSON_OUTPUT", "CORS_ALLOW_ORIGIN", "API_KEY"):
        monkeypatch.delenv(name, raising=False)
    args = parse_args([])
    assert (args.max_concurrent_requests, args.max_best_of, args.max_stop_sequences, args.max_top_n_tokens) == (
        128,
        2,
        4,
        5,
    )
    assert (args.max_input_tokens, args.max_total_tokens, args.max_batch_total_tokens, args.max_batch_size) == (
        None,
        None,
        None,
        None,
    )
    assert (args.waiting_served_ratio, args.max_batch_prefill_tokens, args.max_waiting_tokens) == (1.2, 4096, 20)
    assert (args.hostname, args.port, args.prometheus_port) == ("0.0.0.0", 3000, 9000)
    assert args.master_shard_uds_path == "/tmp/textgen-server-0"
    assert (args.validation_workers, args.max_client_batch_size, args.payload_limit) == (2, 4, 2_000_000)
    assert args.otlp_service_name == "text-generation-inference.router"
    assert (args.json_output, args.disable_grammar_support, args.api_key, args.cors_allow_origin) == (
        False,
        False,
        None,
        None,
    )
    assert args.command is None


def test_env_vars_and_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAX_BATCH_SIZE", "8")
    monkeypatch.setenv("PORT", "4000")
    monkeypatch.setenv("WAITING_SERVED_RATIO", "0.3")
    monkeypatch.setenv("CORS_ALLOW_ORIGIN", "http://a.example")
    monkeypatch.setenv("API_KEY", "k")
    args = parse_args(["-p", "5000"])
    assert (args.max_batch_size, args.port, args.waiting_served_ratio, args.api_key) == (8, 5000, 0.3, "k")
    assert args.cors_allow_origin == ["http://a.example"]
    assert parse_args(["--cors-allow-origin", "x", "--cors-allow-origin", "y"]).cors_allow_origin == ["x", "y"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("true", True),
        ("1", True),
        ("yes", True),
        ("TRUE", True),
        ("false", False),
        ("off", False),
        ("0", False),
        ("n", False),
        ("", False),
    ],
)
def test_boolean_env_values(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    monkeypatch.setenv("JSON_OUTPUT", value)
    assert parse_args([]).json_output is expected


def test_bad_values_are_usage_errors(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MAX_BEST_OF", "two")
    with pytest.raises(SystemExit) as exit_:
        parse_args([])
    assert exit_.value.code == 2
    assert "argument --max-best-of: invalid value 'two': invalid digit found in string" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--prometheus-port", "65536"])
    assert exit_.value.code == 2
    assert "invalid value '65536': number too large to fit in target type" in capsys.readouterr().err


def test_print_schema_is_a_subcommand() -> None:
    assert parse_args(["print-schema"]).command == "print-schema"


def test_hostname_and_log_level() -> None:
    assert listen_address("127.0.0.1") == "127.0.0.1" and listen_address("::1") == "::1"
    assert listen_address("my-container") == "0.0.0.0"  # Docker's HOSTNAME: TGI falls back to every interface
    assert log_level("info,textgen_router=debug") == "INFO"
    assert log_level("warn") == "WARNING" and log_level("textgen=debug") == "INFO"


def test_startup_failures_exit_1_with_tgi_messages() -> None:
    router = [sys.executable, "-m", "textgen_router.main"]
    env = {k: v for k, v in os.environ.items() if k != "MAX_BATCH_SIZE"}
    runs = {
        "workers": subprocess.Popen([*router, "--validation-workers", "0"], stderr=subprocess.PIPE, env=env),
        "batch": subprocess.Popen(router, stderr=subprocess.PIPE, env={**env, "MAX_BATCH_SIZE": "0"}),
        "socket": subprocess.Popen(
            [*router, "--master-shard-uds-path", f"/tmp/tg-missing-{os.getpid()}-0"], stderr=subprocess.PIPE, env=env
        ),
        # Behind the launcher's gate, a closed stdin (the launcher gone before its shards were ready): the router
        # leaves without trying the socket, which would have failed with "Unable to connect".
        "gate": subprocess.Popen(
            [*router, "--master-shard-uds-path", f"/tmp/tg-missing-{os.getpid()}-0"],
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**env, router_gate.GATE_ENV: "1"},
        ),
    }
    results = {}
    for name, proc in runs.items():
        try:
            _, err = proc.communicate(timeout=100)
        finally:
            proc.kill()
        results[name] = (proc.returncode, err.decode())
    assert results["workers"] == (1, "Error: Argument validation error: `validation_workers` must be > 0\n")
    assert results["batch"] == (1, "Error: Argument validation error: `max_batch_size` must be > 0\n")
    code, err = results["socket"]
    assert code == 1 and err.startswith("Error: Unable to connect to the Python model shards: ")
    assert results["gate"] == (1, "Error: the launcher stopped before the shards were ready\n")


@pytest.fixture(scope="module")
def shard_socket(tiny_llama: Path) -> Iterator[str]:
    """One real shard for this module's router processes (one after the other)."""
    with ShardProcess(tiny_llama) as shard:
        yield shard.socket


def test_tokenizer_failure_is_reported_once_the_backend_is_up(shard_socket: str, tmp_path: Path) -> None:
    """The tokenizer loads during warmup, but its failure surfaces after the backend's steps, as in TGI."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "textgen_router.main",
            "--master-shard-uds-path",
            shard_socket,
            "--tokenizer-name",
            str(tmp_path),
            "--port",
            str(free_port()),
            "--prometheus-port",
            str(free_port()),
            "--max-input-tokens",
            "16",
            "--max-total-tokens",
            "32",
            "--max-batch-prefill-tokens",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"Error: Unable to load the tokenizer of {tmp_path}: ")
    assert proc.stdout.index("Setting max batch total tokens") < proc.stdout.index("Unable to load the tokenizer")


def test_sigterm_lets_in_flight_streams_finish(shard_socket: str, tiny_llama: Path) -> None:
    with RouterProcess(shard_socket, tiny_llama) as router:
        # Both listeners are up: the lifecycle-line check below covers two uvicorn servers.
        assert httpx.get(f"http://127.0.0.1:{router.prometheus_port}/metrics", timeout=5).status_code == 200
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": 60}}
        with httpx.stream("POST", router.base_url + "/generate_stream", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith('data:{"index":1,')
            router.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            events = [line for line in lines if line.startswith("data:")]
        assert json.loads(events[-1][5:])["index"] == 60
        assert json.loads(events[-1][5:])["generated_text"] is not None
        assert router.process.wait(timeout=60) == 0  # type: ignore[union-attr]
        log = router.log
        assert "signal received, starting graceful shutdown" in log
        # Two uvicorn listeners (API and Prometheus), one set of lifecycle lines.
        for line in ("Started server process", "Shutting down", "Finished server process"):
            assert log.count(line) == 1, line
