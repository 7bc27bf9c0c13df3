"""Quantized weights served by the real launcher, as a user starts it: a GPTQ checkpoint with no --quantize (the
launcher reads its quantization_config and passes it to the shards) on the packed int4 kernel, bfloat16 being the
CPU default for quantized weights; a float checkpoint with --quantize eetq on the int8 kernel."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from testing.launcher import LauncherProcess
from testing.models import build_quantized_model


def test_a_gptq_checkpoint_starts_without_flags_and_generates(launcher: Callable[..., LauncherProcess]) -> None:
    server = launcher(build_quantized_model("gptq", desc_act=True))
    try:
        body = {"inputs": "The quick brown", "parameters": {"max_new_tokens": 6, "details": True}}
        response = httpx.post(f"{server.base_url}/generate", json=body, timeout=60)
        assert response.status_code == 200
        assert response.json()["details"]["generated_tokens"] == 6
        log = server.log
        assert "'quantize': None" in log  # not given: the launcher read it from the checkpoint
        assert "[shard 0] GPTQ 4-bit (groups of 32, act-order): 8 projections on the int4 kernel" in log
    finally:
        server.stop()


def test_eetq_quantizes_a_float_checkpoint_at_load(launcher: Callable[..., LauncherProcess], tiny_llama: Path) -> None:
    server = launcher(tiny_llama, "--quantize", "eetq")
    try:
        body = {"inputs": "The quick brown", "parameters": {"max_new_tokens": 6}}
        assert httpx.post(f"{server.base_url}/generate", json=body, timeout=60).status_code == 200
        assert "[shard 0] EETQ 8-bit (per channel): 8 projections on the int8 kernel" in server.log
    finally:
        server.stop()
