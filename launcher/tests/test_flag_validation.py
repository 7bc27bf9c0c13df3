"""Invalid flag combinations (TGI launcher §1.2/§1.3): the real launcher exits non-zero with TGI's message
before it starts any process."""

from __future__ import annotations

from pathlib import Path

import pytest

from testing.launcher import run_launcher, short_uds_prefix

CASES = [
    (
        ["--num-shard", "2", "--quantize", "exl2"],
        {},
        'Error: ArgumentValidation("Sharding is currently not supported with `exl2` quantization")',
    ),
    (
        ["--max-input-tokens", "10", "--max-input-length", "10"],
        {},
        "Both `max_input_tokens` (10) and `max_input_length` (10) are set. Please define only `max_input_tokens` "
        "as `max_input_length is deprecated for naming consistency.",
    ),
    (
        ["--max-input-tokens", "10", "--max-total-tokens", "10"],
        {},
        'Error: ArgumentValidation("`max_input_tokens`(10) must be < `max_total_tokens`(10)")',
    ),
    ([], {"MAX_INPUT_LENGTH": "20", "MAX_TOTAL_TOKENS": "8"}, "`max_input_tokens`(20) must be < `max_total_tokens`(8)"),
    (["--validation-workers", "0"], {}, "`validation_workers` must be > 0"),
    (
        ["--max-total-tokens", "100", "--max-batch-total-tokens", "50"],
        {},
        "`max_total_tokens` must be <= `max_batch_total_tokens`. Given: 100 and 50",
    ),
    (["--ngrok"], {}, "`ngrok-authtoken` must be set when using ngrok tunneling"),
    (["--ngrok", "--ngrok-authtoken", "t"], {}, "`ngrok-edge` must be set when using ngrok tunneling"),
    (["--ngrok", "--ngrok-authtoken", "t", "--ngrok-edge", "e"], {}, "ngrok tunneling is not supported by textgen"),
    (["--sharded", "true", "--num-shard", "1"], {}, "`sharded` is true but `num_shard` <= 1"),
    (["--num-shard", "0"], {}, 'Error: ArgumentValidation("`num_shard` cannot be < 1")'),
    (
        ["--sharded", "true"],
        {"CUDA_VISIBLE_DEVICES": "0"},
        'Error: NotEnoughCUDADevices("`sharded` is true but only found 1 CUDA devices")',
    ),
    (
        ["--sharded", "true", "--quantize", "exl2"],
        {"ZE_AFFINITY_MASK": "0,1"},
        "Sharding is currently not supported with `exl2` quantization",
    ),
]


def _assert_nothing_started(output: str, uds: str) -> None:
    assert "Starting" not in output
    assert not list(Path("/tmp").glob(Path(uds).name + "*"))


@pytest.mark.parametrize(("args", "env", "message"), CASES, ids=[c[2][:40] for c in CASES])
def test_invalid_combination_is_rejected(args: list[str], env: dict[str, str], message: str) -> None:
    uds = short_uds_prefix()
    result = run_launcher(["--model-id", "/nonexistent-model", "--shard-uds-path", uds, *args], env)
    assert result.returncode == 1, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    _assert_nothing_started(result.stdout + result.stderr, uds)


def test_sharded_without_any_device_count_panics_like_tgi() -> None:
    result = run_launcher(["--model-id", "/nonexistent-model", "--sharded", "true"])
    assert result.returncode == 101
    assert "--num-shard and CUDA_VISIBLE_DEVICES/NVIDIA_VISIBLE_DEVICES/ZE_AFFINITY_MASK are not set" in result.stderr


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--quantize", "int3"], {}, "argument --quantize: invalid choice: 'int3'"),
        ([], {"QUANTIZE": "int3"}, "invalid choice: 'int3' from env QUANTIZE"),
        ([], {"PORT": "eighty"}, "argument -p/--port: invalid value 'eighty': invalid digit found in string"),
        # TGI's flags are Rust unsigned integers: clap refuses these before anything starts.
        (["--port", "70000"], {}, "invalid value '70000': number too large to fit in target type"),
        (["--max-concurrent-requests", "-1"], {}, "invalid value '-1': invalid digit found in string"),
        (["--num-shard", "-1"], {}, "argument --num-shard: invalid value '-1'"),
        ([], {"MAX_BATCH_PREFILL_TOKENS": "4294967296"}, "number too large to fit in target type"),
        (["--validation-workers", ""], {}, "cannot parse integer from empty string"),
        (["--sharded", "yes"], {}, "invalid value 'yes' (possible values: true, false)"),
        (["--cuda-graphs", "1,x"], {}, "expected comma-separated integers"),
        ([], {"CUDA_GRAPHS": "1,-2"}, "invalid value '1,-2' (expected non-negative integers)"),
        (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
    ],
)
def test_unparsable_flag_values_exit_2(args: list[str], env: dict[str, str], message: str) -> None:
    result = run_launcher(args, env)
    assert result.returncode == 2
    assert message in result.stderr


def test_bad_lora_adapter_format(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")  # local weights: the download step is skipped
    uds = short_uds_prefix()
    result = run_launcher(
        ["--model-id", str(tmp_path), "--shard-uds-path", uds, "--port", "0", "--lora-adapters", "org/a@v1@v2"]
    )
    assert result.returncode == 1
    assert "Invalid LoRA adapter format: org/a@v1@v2" in result.stderr
    _assert_nothing_started(result.stdout, uds)


def test_env_prints_runtime_and_exits() -> None:
    result = run_launcher(["--env"])
    assert result.returncode == 0, result.stderr
    for line in ("Python version: 3.", "torch version: ", "CUDA available: ", "Devices: "):
        assert line in result.stdout
    assert "Starting" not in result.stdout
