"""The download step: `textgen-server download-weights` as a child, output forwarded as it runs."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from pathlib import Path

from textgen_common.lora_adapters import parse_lora_adapters
from textgen_launcher.children import Child, stop_all
from textgen_launcher.environment import base_env
from textgen_launcher.errors import ArgumentValidation, DownloadError
from textgen_launcher.forward import LineForwarder

logger = logging.getLogger("textgen_launcher")
SERVER_BIN = "textgen-server"
DOWNLOAD_STOP_GRACE_S = 10.0


def has_local_weights(model_id: str) -> bool:
    """A local directory that already holds safetensors needs neither download nor conversion."""
    path = Path(model_id)
    return path.is_dir() and any(path.glob("*.safetensors"))


def _failure_reason(forwarder: LineForwarder, child: Child, returncode: int) -> str:
    """One line: the child's last logged error, else the last stderr line (a traceback's final line)."""
    if returncode < 0:
        return f"Download process was signaled to shutdown with signal {-returncode}"
    lines = [line.strip() for line in child.stderr_tail if line.strip()]
    return forwarder.last_error or (lines[-1] if lines else f"exit code {returncode}")


def run_download(args: argparse.Namespace, model_id: str, revision: str | None, running: Callable[[], bool]) -> bool:
    """Runs one download; False if a stop signal arrived meanwhile. Raises DownloadError on failure.

    Unlike TGI, neither `--merge-lora` nor `--trust-remote-code`: textgen's download-weights merges no PEFT
    adapter and runs no model code.
    """
    cmd = [
        SERVER_BIN,
        "download-weights",
        model_id,
        "--extension",
        ".safetensors",
        "--logger-level",
        "INFO",
        "--json-output",
    ]
    if revision:
        cmd += ["--revision", revision]
    logger.info("Starting check and download process for %s", model_id)
    forwarder = LineForwarder("download", {"step": "download"}, args.json_output)
    try:
        child = Child("download", cmd, base_env(args), forwarder.emit, echo_stderr=False)
    except FileNotFoundError:
        logger.error("%s not found in PATH", SERVER_BIN)
        logger.error("Please install it with `make install`")
        raise DownloadError() from None
    while child.poll() is None:
        if not running():
            stop_all([child], DOWNLOAD_STOP_GRACE_S)
            return False
        time.sleep(0.1)
    child.drain()
    if child.poll() != 0:
        logger.error("Download encountered an error: %s", _failure_reason(forwarder, child, child.poll() or 0))
        logger.debug("Download standard error output:\n%s", child.stderr_text())
        raise DownloadError()
    logger.info("Successfully downloaded weights for %s", model_id)
    return True


def download_all(args: argparse.Namespace, running: Callable[[], bool]) -> bool:
    """The model, then each LoRA adapter (TGI step 14)."""
    if has_local_weights(args.model_id):
        logger.info("Weights of %s are already on the host: skipping the download step", args.model_id)
    elif not run_download(args, args.model_id, args.revision, running):
        return False
    try:
        adapters = parse_lora_adapters(args.lora_adapters)
    except ValueError as error:
        raise ArgumentValidation(str(error)) from None
    for adapter in adapters:
        if adapter.local:  # `name=path` adapters are local paths
            continue
        if not run_download(args, adapter.source, adapter.revision, running):
            return False
    return True
