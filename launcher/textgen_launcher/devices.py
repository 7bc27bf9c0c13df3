"""How many shards to run: TGI's `find_num_shards` / `num_cuda_devices`, plus Ascend and a torch fallback."""

from __future__ import annotations

import os
import shutil
import subprocess

from textgen_launcher.errors import ArgumentValidation, NotEnoughCUDADevices

DEVICE_ENV_VARS = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")
NO_DEVICE_MESSAGE = "--num-shard and CUDA_VISIBLE_DEVICES/NVIDIA_VISIBLE_DEVICES/ZE_AFFINITY_MASK are not set"


class NoDeviceFound(Exception):
    """TGI panics here (exit code 101) rather than returning a launcher error."""


def nvidia_smi(*query: str) -> list[str] | None:
    """Data lines of `nvidia-smi --query-gpu=... --format=csv,noheader`, or None without a working nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(query)}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.splitlines() if line.strip()]


def has_gpu_driver() -> bool:
    """Whether asking torch about CUDA/ROCm devices can return anything.

    Importing torch costs seconds of launcher start-up; a host without a driver has no device to find.
    """
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd")) or shutil.which("nvidia-smi") is not None


def num_cuda_devices() -> int | None:
    """Devices named by the first visibility variable set; else what torch sees (None when nothing is found)."""
    for name in DEVICE_ENV_VARS:
        value = os.environ.get(name)
        if value is None:
            continue
        if name == "NVIDIA_VISIBLE_DEVICES" and value.strip() in ("all", "void"):
            uuids = nvidia_smi("uuid")
            if uuids is not None:
                return len(uuids)
        # An empty string counts as one device, as in TGI.
        return len(value.split(","))
    if has_gpu_driver():
        import torch

        count = torch.cuda.device_count()
        return count or None
    return None


def find_num_shards(sharded: bool | None, num_shard: int | None) -> int:
    """TGI's table: an explicit count wins, `--sharded false` means one, otherwise count the devices."""
    if sharded is True and num_shard is None:
        count = num_cuda_devices()
        if count is None:
            raise NoDeviceFound(NO_DEVICE_MESSAGE)
        if count <= 1:
            raise NotEnoughCUDADevices(f"`sharded` is true but only found {count} CUDA devices")
        result = count
    elif sharded is True:
        assert num_shard is not None
        if num_shard <= 1:
            raise ArgumentValidation("`sharded` is true but `num_shard` <= 1")
        result = num_shard
    elif num_shard is not None:
        result = num_shard
    elif sharded is False:
        result = 1
    else:
        result = num_cuda_devices() or 1
    if result < 1:
        raise ArgumentValidation("`num_shard` cannot be < 1")
    return result
