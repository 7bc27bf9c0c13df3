"""`--lora-adapters` naming an adapter the shards cannot load stops the real launcher with a clear line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from testing.launcher import LauncherProcess


def test_a_missing_adapter_path_is_a_clear_startup_error(
    launcher: Callable[..., LauncherProcess], tiny_llama: Path
) -> None:
    handle = launcher(tiny_llama, "--lora-adapters", "gone=/nonexistent/adapter", wait=False)
    try:
        assert handle.wait_exit(timeout=180) == 1
        assert "LoRA adapter gone: /nonexistent/adapter has no adapter_config.json" in handle.log
        assert "Shard 0 failed to start" in handle.log
    finally:
        handle.stop()
