"""`--env`: what a bug report needs to know about this host (TGI's `env_runtime`)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata

from textgen_launcher.devices import DEVICE_ENV_VARS


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _command_output(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "N/A"


def runtime_env() -> str:
    import torch

    cuda = torch.cuda.is_available()
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    lines = [
        f"Platform: {platform.platform()} ({platform.machine()})",
        f"Python version: {sys.version.split()[0]}",
        f"textgen version: {_version('textgen')}",
        f"torch version: {torch.__version__} (CUDA build: {torch.version.cuda or 'none'})",
        f"transformers version: {_version('transformers')}",
        f"CUDA available: {cuda}",
        f"Devices: {', '.join(devices) if devices else 'none (CPU shards)'}",
        f"CPU cores: {os.cpu_count()}",
        f"Docker label: {os.environ.get('DOCKER_LABEL', 'N/A')}",
    ]
    lines += [f"{name}: {os.environ.get(name, 'N/A')}" for name in DEVICE_ENV_VARS]
    lines.append(f"nvidia-smi:\n{_command_output('nvidia-smi')}")
    return "\n".join(lines)
