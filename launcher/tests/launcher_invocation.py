"""Running the real `textgen-launcher` binary in tests."""
from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Mapping, Sequence

DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")
# Env vars of launcher flags that a developer's shell could set and that would change what a test means.
FLAG_VARS = ("MODEL_ID", "NUM_SHARD", "SHARDED", "PORT", "HOSTNAME", "MAX_INPUT_TOKENS", "MAX_TOTAL_TOKENS",
             "MAX_INPUT_LENGTH", "MAX_BATCH_PREFILL_TOKENS", "MAX_BATCH_TOTAL_TOKENS", "QUANTIZE", "API_KEY",
             "SHARD_UDS_PATH", "JSON_OUTPUT", "LOG_LEVEL", "ATTENTION", "PREFIX_CACHING")


def short_uds_prefix() -> str:
    """Short and unique: AF_UNIX paths must stay under ~100 characters."""
    return f"/tmp/tgl-{uuid.uuid4().hex[:10]}"


def launcher_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DEVICE_VARS + FLAG_VARS}
    env["HF_HUB_OFFLINE"] = "1"  # no hub is reachable: fail fast instead of waiting on the network
    env.update(extra or {})
    return env


def run_launcher(args: Sequence[str], env: Mapping[str, str] | None = None,
                 timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["textgen-launcher", *args], env=launcher_env(env), capture_output=True, text=True,
                          timeout=timeout)
