"""The shard's C++ CPU ops, one library built at first use: attention over the KV caches (decode_attention.cpp,
see decode_attention.py and paged_attention.py), a decoder layer's small ops (fused_ops.cpp: norm.py, rotary.py,
the MLP of models/tp_llama.py), the greedy token choice (token_ops.cpp: sampling/greedy.py), a bfloat16 projection
of a few rows (linear_ops.cpp: linear_choice.py) and one row of a 4-bit or an 8-bit projection (int4_ops.cpp,
int8_ops.cpp: quant_kernels.py), sharing the helpers of cpu_ops.h, and a decode step's decoder layer in two calls of
those ops (decode_blocks.cpp: models/tp_llama.py).

They are compiled for this CPU (-march=native, or TEXTGEN_CPU_ARCH) with torch's extension builder (a C++ compiler
and ninja; once per machine and target, cached under TORCH_EXTENSIONS_DIR). Where the library cannot be built, or
with TEXTGEN_CPU_DECODE_KERNEL=0 or DISABLE_CUSTOM_KERNELS, every caller keeps its torch code.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from textgen_server.config import custom_kernels_disabled

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = tuple(
    _HERE / name
    for name in (
        "decode_attention.cpp",
        "fused_ops.cpp",
        "token_ops.cpp",
        "linear_ops.cpp",
        "int4_ops.cpp",
        "int8_ops.cpp",
        "attention_products.cpp",
        "prefill_attention.cpp",
        "decode_blocks.cpp",
    )
)
HEADERS = (_HERE / "cpu_ops.h", _HERE / "kv_pool.h", _HERE / "torch_order.h")
ENV_SWITCH = "TEXTGEN_CPU_DECODE_KERNEL"
# The CPU the ops are compiled for (gcc's -march): this machine's by default. An older target (x86-64-v3: the AVX2
# servers) builds and tests another vector path on an AVX-512 machine (tests/test_cpu_targets.py).
ARCH_ENV = "TEXTGEN_CPU_ARCH"
# Written beside a library once `load` built it, naming the torch and the flags it was built with.
BUILT_STAMP = "textgen-built"


def x86_bf16_hardware() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), or is not x86 (where torch's
    flags below say nothing: an ARM server's BF16 extension is not among them)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def cpu_flags() -> set[str]:
    """This CPU's feature flags as the kernel lists them (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return set(next(line for line in cpuinfo if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return set()


def _cpu_tag() -> str:
    """A short hash of this CPU's feature flags: built with -march=native, the library must never be loaded by
    another CPU model from a shared build cache."""
    flags = " ".join(sorted(cpu_flags())) or platform.processor()
    return hashlib.sha1(flags.encode()).hexdigest()[:12]


def files_digest(paths: Iterable[Path]) -> str:
    """The SHA-1 of the files' bytes, in order (hex)."""
    digest = hashlib.sha1()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _source_tag() -> str:
    """A short hash of the sources: worktrees or versions with other sources sharing one build cache would
    otherwise rebuild the one name over each other, and a process could load a library without its ops."""
    return files_digest((*SOURCES, *HEADERS))[:8]


@functools.cache
def kernel_available() -> bool:
    """Load the ops, building them first where no finished build of these sources for this CPU, torch and flags is
    at hand; False, with a warning, when they cannot be built."""
    arch = os.environ.get(ARCH_ENV, "native")
    if not re.fullmatch(r"[\w.+-]+", arch):
        logger.warning("CPU ops unavailable, using torch's: %s=%r is not a -march target", ARCH_ENV, arch)
        return False
    cflags = ["-O3", f"-march={arch}", "-fopenmp"]
    name = library_name(arch)
    # The name holds the sources and the CPU; the stamp, torch and the flags.
    built_for = f"torch {torch.__version__} {' '.join(cflags)}"
    try:
        directory = torch_build_directory(name)
        # torch's `load` writes build.ninja, runs ninja and takes a lock file even when the library is built (about
        # a second of every start, and a lock left by a process killed mid-build blocks every later start): a build
        # that `load` finished is loaded as it is, from a read-only volume too.
        if not _load_finished(directory, name, built_for):
            directory = _writable(directory)
            if not _load_finished(directory, name, built_for):
                from torch.utils.cpp_extension import load

                load(
                    name=name,
                    sources=[str(path) for path in SOURCES],
                    extra_cflags=cflags,
                    build_directory=str(directory),
                    is_python_module=False,
                    verbose=False,
                )
                (directory / BUILT_STAMP).write_text(built_for)
    except Exception as err:  # no compiler, no ninja, an unsupported platform: the torch code still works
        logger.warning("CPU ops unavailable, using torch's: %s", err)
        return False
    return True


def _load_finished(directory: Path, name: str, built_for: str) -> bool:
    """Load `directory`'s library if `load` finished it for `built_for` (its stamp says so); whether it did."""
    stamp, library = directory / BUILT_STAMP, directory / f"{name}.so"
    try:
        if stamp.read_text() != built_for or not library.is_file():
            return False
    except OSError:
        return False
    torch.ops.load_library(str(library))
    return True


def library_name(arch: str) -> str:
    """The library's name for a -march target: it changes with the sources and the CPU."""
    return f"textgen_cpu_ops_{_cpu_tag()}_{_source_tag()}_{re.sub(r'[^0-9A-Za-z_]', '_', arch)}"


def torch_build_directory(name: str) -> Path:
    """Where torch's `load` builds `name`: TORCH_EXTENSIONS_DIR/name, else a folder per Python and accelerator
    under torch's cache."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root) / name
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def _writable(directory: Path) -> Path:
    """`directory`, created, unless it cannot be written (TORCH_EXTENSIONS_DIR on a read-only Docker volume); then a
    directory under the system's temporary one, with a warning."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            return directory
    except OSError as err:
        fallback = Path(tempfile.gettempdir()) / "textgen_torch_extensions" / directory.name
        logger.warning("TORCH_EXTENSIONS_DIR cannot be written (%s): building the CPU ops under %s", err, fallback)
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def switched_on() -> bool:
    """False when TEXTGEN_CPU_DECODE_KERNEL=0 or DISABLE_CUSTOM_KERNELS (config.custom_kernels_disabled) turns the
    ops off; then the library is never even loaded."""
    return os.environ.get(ENV_SWITCH, "1") != "0" and not custom_kernels_disabled()


def ops_for(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether tensors of `dtype` on `device` go to the ops: float32 and bfloat16 on a CPU, where they build,
    unless switched off."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and switched_on() and kernel_available()
