"""Pure launcher logic: shard count table, automatic prefill budget, attention resolution, child env."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from textgen_launcher.args import parse_args
from textgen_launcher.attention_defaults import resolve_attention
from textgen_launcher.config import load_config, parse_config
from textgen_launcher.devices import DEVICE_ENV_VARS, NoDeviceFound, find_num_shards
from textgen_launcher.environment import rope_env, router_env, shard_env
from textgen_launcher.errors import ArgumentValidation, NotEnoughCUDADevices
from textgen_launcher.limits import compute_optimal, default_max_batch_prefill_tokens, vram_cap
from textgen_launcher.main import log_level
from textgen_launcher.router import router_command
from textgen_launcher.shards import shard_command
from textgen_launcher.validate import Settings

LLAMA_7B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_hidden_layers": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}


@pytest.fixture(autouse=True)
def no_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in DEVICE_ENV_VARS + ("ATTENTION", "PREFIX_CACHING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("textgen_launcher.devices.has_gpu_driver", lambda: False)


@pytest.mark.parametrize(
    ("env", "sharded", "num_shard", "expected"),
    [
        ({}, None, None, 1),
        ({}, None, 3, 3),
        ({}, False, None, 1),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, False, None, 1),
        ({}, False, 2, 2),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, None, None, 3),
        ({"CUDA_VISIBLE_DEVICES": "0,1", "NVIDIA_VISIBLE_DEVICES": "0"}, True, None, 2),
        ({"NVIDIA_VISIBLE_DEVICES": "2,3"}, None, None, 2),
        ({"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"}, True, None, 4),
        ({"ZE_AFFINITY_MASK": "0,1"}, None, None, 2),
        ({"CUDA_VISIBLE_DEVICES": ""}, None, None, 1),
    ],
)
def test_shard_count_table(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], sharded: bool | None, num_shard: int | None, expected: int
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert find_num_shards(sharded, num_shard) == expected


def test_shard_count_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(NoDeviceFound):
        find_num_shards(True, None)
    with pytest.raises(ArgumentValidation, match="`sharded` is true but `num_shard` <= 1"):
        find_num_shards(True, 1)
    with pytest.raises(ArgumentValidation, match="`num_shard` cannot be < 1"):
        find_num_shards(None, 0)
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "1")
    with pytest.raises(NotEnoughCUDADevices, match="only found 1 CUDA devices"):
        find_num_shards(True, None)


def test_prefill_default_on_cpu_is_4096_clamped_to_context() -> None:
    assert default_max_batch_prefill_tokens(None, 1, 1.0) == 4096
    small = parse_config({**LLAMA_7B, "max_position_embeddings": 512})
    assert default_max_batch_prefill_tokens(small, 1, 1.0) == 512
    gemma3 = parse_config({**LLAMA_7B, "model_type": "gemma3", "max_position_embeddings": 131072})
    assert default_max_batch_prefill_tokens(gemma3, 1, 1.0) == 8000


def test_prefill_from_card_flops_and_vram() -> None:
    config = parse_config(LLAMA_7B)
    assert config is not None and config.head_dim == 128
    # 900 TFLOPS over ~13 GFLOPs per token of a 7B llama.
    optimal = compute_optimal(config, ["NVIDIA H100 80GB HBM3"], 1)
    assert optimal is not None and 60_000 < optimal < 75_000
    assert compute_optimal(config, ["Some Unknown Card"], 1) is None
    # 16 GiB holds the ~13.5 GB of f16 weights and little else; 80 GiB holds far more.
    assert vram_cap(config, ["16384 MiB"], 1, 1.0) < vram_cap(config, ["81559 MiB"], 1, 1.0)
    assert vram_cap(config, ["81559 MiB"], 1, 1.0) > 100_000


def test_prefill_estimates_without_the_fields_they_need() -> None:
    # Configs that name head_dim but lack a field an estimate multiplies by: no estimate rather than a crash.
    no_heads = parse_config({k: v for k, v in LLAMA_7B.items() if k != "num_attention_heads"} | {"head_dim": 128})
    assert no_heads is not None and no_heads.num_heads is None
    assert compute_optimal(no_heads, ["NVIDIA H100 80GB HBM3"], 1) is None
    assert vram_cap(no_heads, ["81559 MiB"], 1, 1.0) is None
    unsized = {k: v for k, v in LLAMA_7B.items() if k not in ("hidden_size", "intermediate_size")}
    moe = parse_config(unsized | {"head_dim": 128, "num_experts_per_tok": 2})
    assert moe is not None and moe.intermediate_size is None
    assert vram_cap(moe, ["81559 MiB"], 1, 1.0) is None


def test_hub_config_comes_from_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    snapshot = tmp_path / "models--org--model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({**LLAMA_7B, "max_position_embeddings": 1024}))
    (tmp_path / "models--org--model" / "refs").mkdir()
    (tmp_path / "models--org--model" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path))
    config = load_config("org/model", None)
    assert config is not None and config.max_position_embeddings == 1024
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert load_config("org/other-model", None) is None
    assert load_config("/not/a/repo/id", None) is None


def test_unknown_quant_method_means_no_config() -> None:
    assert parse_config({**LLAMA_7B, "quantization_config": {"quant_method": "mystery"}}) is None
    assert parse_config({**LLAMA_7B, "quantization_config": {"quant_method": "gptq"}}).quantize == "gptq"


def test_attention_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_attention(None, None) == ("flashinfer", "true")
    assert resolve_attention(parse_config(LLAMA_7B), None) == ("flashinfer", "true")
    assert resolve_attention(parse_config(LLAMA_7B), "org/adapter") == ("flashinfer", "0")
    odd_head = parse_config({**LLAMA_7B, "head_dim": 80})
    assert resolve_attention(odd_head, None) == ("paged", "0")
    falcon = parse_config({**LLAMA_7B, "model_type": "falcon"})
    assert resolve_attention(falcon, None) == ("paged", "0")
    # Unlike TGI, a VLM keeps the prefix cache (images are keyed by their bytes); a seq2seq model does not.
    assert resolve_attention(parse_config({**LLAMA_7B, "vision_config": {}}), None) == ("flashinfer", "true")
    assert resolve_attention(parse_config({**LLAMA_7B, "is_encoder_decoder": True}), None) == ("flashinfer", "0")
    monkeypatch.setenv("ATTENTION", "flashdecoding")
    monkeypatch.setenv("PREFIX_CACHING", "1")
    assert resolve_attention(odd_head, None) == ("flashdecoding", "1")


def test_rope_env_implies_the_missing_half() -> None:
    assert rope_env(None, None) == {}
    assert rope_env("dynamic", None) == {"ROPE_SCALING": "dynamic", "ROPE_FACTOR": "1.0"}
    assert rope_env(None, 2.0) == {"ROPE_SCALING": "linear", "ROPE_FACTOR": "2.0"}


def test_shard_command_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOG_LEVEL", "debug")
    monkeypatch.setenv("HF_API_TOKEN", "hf_x")
    args = parse_args(
        [
            "--model-id",
            "m",
            "--dtype",
            "bfloat16",
            "--shard-uds-path",
            "/tmp/s",
            "--max-input-tokens",
            "7",
            "--watermark-gamma",
            "0.5",
            "--enable-prefill-logprobs",
            "--cuda-graphs",
            "0",
            "--otlp-endpoint",
            "http://c:4317",
            "--otlp-service-name",
            "svc",
        ]
    )
    settings = Settings(num_shard=2, max_input_tokens=7, max_batch_prefill_tokens=64, quantize=None, cuda_graphs=[])
    assert shard_command(args, settings, "DEBUG") == [
        "textgen-server",
        "serve",
        "m",
        "--uds-path",
        "/tmp/s",
        "--logger-level",
        "DEBUG",
        "--json-output",
        "--sharded",
        "--dtype",
        "bfloat16",
        "--otlp-endpoint",
        "http://c:4317",
        "--otlp-service-name",
        "svc",
        "--max-input-tokens",
        "7",
    ]
    env = shard_env(args, settings, 1)
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("1", "2", "localhost", "29500")
    assert env["HF_TOKEN"] == "hf_x" and env["WATERMARK_GAMMA"] == "0.5" and env["REQUEST_LOGPROBS"] == "1"
    assert "LOG_LEVEL" not in env and "CUDA_GRAPHS" not in env and "WATERMARK_DELTA" not in env


def test_router_command_passes_limits_and_repeated_origins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COMPUTE_TYPE", raising=False)
    args = parse_args(
        [
            "--model-id",
            "/models/m",
            "--shard-uds-path",
            "/tmp/s",
            "--port",
            "8080",
            "--cors-allow-origin",
            "a",
            "--cors-allow-origin",
            "b",
            "--json-output",
            "--otlp-endpoint",
            "http://127.0.0.1:4317",
            "--api-key",
            "secret",
            "--huggingface-hub-cache",
            "/data",
        ]
    )
    settings = Settings(
        num_shard=1, max_input_tokens=None, max_batch_prefill_tokens=512, quantize=None, cuda_graphs=[1]
    )
    cmd = router_command(args, settings)
    pairs = dict(zip(cmd[1::2], cmd[2::2], strict=False))
    assert pairs["--master-shard-uds-path"] == "/tmp/s-0"
    assert pairs["--tokenizer-name"] == "/models/m"
    assert pairs["--max-batch-prefill-tokens"] == "512" and pairs["--port"] == "8080"
    assert "--max-input-tokens" not in cmd and "--json-output" in cmd
    assert cmd.count("--cors-allow-origin") == 2
    assert pairs["--otlp-endpoint"] == "http://127.0.0.1:4317"
    assert pairs["--otlp-service-name"] == "text-generation-inference.router"
    assert "secret" not in cmd  # the key travels in the router's environment
    env = router_env(args, 1, "NVIDIA A10G")
    assert env["API_KEY"] == "secret" and env["COMPUTE_TYPE"] == "1-nvidia-a10g"
    assert env["HUGGINGFACE_HUB_CACHE"] == "/data"
    assert "--image-fetch-allowed-hosts" not in cmd and "--image-fetch-allow-link-local" not in cmd  # not given


def test_router_command_passes_the_image_fetch_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """textgen's own flags (not TGI's): what a vision-language model's image URLs may reach."""
    monkeypatch.setenv("IMAGE_FETCH_ALLOW_LINK_LOCAL", "true")
    args = parse_args(["--model-id", "/models/m", "--image-fetch-allowed-hosts", "img.example.com,*.cdn.net"])
    settings = Settings(num_shard=1, max_input_tokens=None, max_batch_prefill_tokens=512, quantize=None, cuda_graphs=[])
    cmd = router_command(args, settings)
    assert cmd[cmd.index("--image-fetch-allowed-hosts") + 1] == "img.example.com,*.cdn.net"
    assert "--image-fetch-allow-link-local" in cmd


@pytest.mark.parametrize(
    ("value", "level"),
    [
        ("debug", "DEBUG"),
        ("warn", "WARNING"),
        ("info,textgen_router=debug", "INFO"),
        ("textgen_launcher=warn,info", "WARNING"),
        ("text_generation_launcher=debug", "DEBUG"),
        ("bogus", "INFO"),
    ],
)
def test_log_level_from_env(monkeypatch: pytest.MonkeyPatch, value: str, level: str) -> None:
    monkeypatch.setenv("LOG_LEVEL", value)
    assert log_level() == level


# (flag's dest, its env var, TGI's default, an env value, what that value parses to)
TGI_FLAGS = [
    ("model_id", "MODEL_ID", "bigscience/bloom-560m", "org/m", "org/m"),
    ("revision", "REVISION", None, "refs/pr/2", "refs/pr/2"),
    ("validation_workers", "VALIDATION_WORKERS", 2, "3", 3),
    ("sharded", "SHARDED", None, "false", False),
    ("num_shard", "NUM_SHARD", None, "2", 2),
    ("quantize", "QUANTIZE", None, "gptq", "gptq"),
    ("speculate", "SPECULATE", None, "2", 2),
    ("dtype", "DTYPE", None, "bfloat16", "bfloat16"),
    ("kv_cache_dtype", "KV_CACHE_DTYPE", None, "fp8_e5m2", "fp8_e5m2"),
    ("trust_remote_code", "TRUST_REMOTE_CODE", False, "true", True),
    ("max_concurrent_requests", "MAX_CONCURRENT_REQUESTS", 128, "7", 7),
    ("max_best_of", "MAX_BEST_OF", 2, "3", 3),
    ("max_stop_sequences", "MAX_STOP_SEQUENCES", 4, "5", 5),
    ("max_top_n_tokens", "MAX_TOP_N_TOKENS", 5, "6", 6),
    ("max_input_tokens", "MAX_INPUT_TOKENS", None, "10", 10),
    ("max_input_length", "MAX_INPUT_LENGTH", None, "10", 10),
    ("max_total_tokens", "MAX_TOTAL_TOKENS", None, "20", 20),
    ("waiting_served_ratio", "WAITING_SERVED_RATIO", 0.3, "1.2", 1.2),
    ("max_batch_prefill_tokens", "MAX_BATCH_PREFILL_TOKENS", None, "64", 64),
    ("max_batch_total_tokens", "MAX_BATCH_TOTAL_TOKENS", None, "128", 128),
    ("max_waiting_tokens", "MAX_WAITING_TOKENS", 20, "8", 8),
    ("max_batch_size", "MAX_BATCH_SIZE", None, "4", 4),
    ("cuda_graphs", "CUDA_GRAPHS", None, "1,2,0", [1, 2, 0]),
    ("hostname", "HOSTNAME", "0.0.0.0", "127.0.0.1", "127.0.0.1"),
    ("port", "PORT", 3000, "80", 80),
    ("prometheus_port", "PROMETHEUS_PORT", 9000, "9001", 9001),
    ("shard_uds_path", "SHARD_UDS_PATH", "/tmp/textgen-server", "/tmp/x", "/tmp/x"),
    ("master_addr", "MASTER_ADDR", "localhost", "10.0.0.1", "10.0.0.1"),
    ("master_port", "MASTER_PORT", 29500, "29501", 29501),
    ("huggingface_hub_cache", "HUGGINGFACE_HUB_CACHE", None, "/data", "/data"),
    ("weights_cache_override", "WEIGHTS_CACHE_OVERRIDE", None, "/w", "/w"),
    ("disable_custom_kernels", "DISABLE_CUSTOM_KERNELS", False, "1", True),
    ("cuda_memory_fraction", "CUDA_MEMORY_FRACTION", 1.0, "0.5", 0.5),
    ("rope_scaling", "ROPE_SCALING", None, "dynamic", "dynamic"),
    ("rope_factor", "ROPE_FACTOR", None, "2", 2.0),
    ("json_output", "JSON_OUTPUT", False, "off", False),
    ("otlp_endpoint", "OTLP_ENDPOINT", None, "http://c:4317", "http://c:4317"),
    ("otlp_service_name", "OTLP_SERVICE_NAME", "text-generation-inference.router", "svc", "svc"),
    ("cors_allow_origin", "CORS_ALLOW_ORIGIN", [], "https://a", ["https://a"]),
    ("api_key", "API_KEY", None, "k", "k"),
    ("watermark_gamma", "WATERMARK_GAMMA", None, "0.5", 0.5),
    ("watermark_delta", "WATERMARK_DELTA", None, "2", 2.0),
    ("ngrok", "NGROK", False, "yes", True),
    ("ngrok_authtoken", "NGROK_AUTHTOKEN", None, "t", "t"),
    ("ngrok_edge", "NGROK_EDGE", None, "e", "e"),
    ("tokenizer_config_path", "TOKENIZER_CONFIG_PATH", None, "/t.json", "/t.json"),
    ("disable_grammar_support", "DISABLE_GRAMMAR_SUPPORT", False, "true", True),
    ("max_client_batch_size", "MAX_CLIENT_BATCH_SIZE", 4, "8", 8),
    ("lora_adapters", "LORA_ADAPTERS", None, "a,b", "a,b"),
    ("usage_stats", "USAGE_STATS", "on", "off", "off"),
    ("payload_limit", "PAYLOAD_LIMIT", 2000000, "10", 10),
    ("enable_prefill_logprobs", "ENABLE_PREFILL_LOGPROBS", False, "true", True),
    ("graceful_termination_timeout", "GRACEFUL_TERMINATION_TIMEOUT", 90, "5", 5),
]


@pytest.mark.parametrize(("dest", "env", "default", "env_value", "parsed"), TGI_FLAGS, ids=[f[1] for f in TGI_FLAGS])
def test_every_tgi_flag_has_its_default_and_env_var(
    monkeypatch: pytest.MonkeyPatch, dest: str, env: str, default: object, env_value: str, parsed: object
) -> None:
    monkeypatch.delenv(env, raising=False)
    assert getattr(parse_args([]), dest) == default
    monkeypatch.setenv(env, env_value)
    assert getattr(parse_args([]), dest) == parsed
    flag = "--" + dest.replace("_", "-")
    if isinstance(default, bool):  # the command line wins over the environment
        assert getattr(parse_args([flag]), dest) is True
    elif dest == "cors_allow_origin":
        assert parse_args([flag, "https://b"]).cors_allow_origin == ["https://b"]
    else:
        assert getattr(parse_args([flag, env_value]), dest) == parsed


def test_env_flag_is_cli_only() -> None:
    assert parse_args(["-e"]).env is True and parse_args([]).env is False
