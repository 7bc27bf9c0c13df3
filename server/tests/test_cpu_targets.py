"""Which CPU the C++ ops are built for, and where.

The AVX2 path is tested on any x86 machine that has AVX2 (an AVX-512 one included).

An AVX2-only server (AMD Zen 2 and 3, Intel before Skylake-SP) builds the ops without AVX-512, and torch runs
its AVX2 kernels there. On an AVX-512 machine the AVX2 test does the same in a process of its own:
- the library is built for x86-64-v3 (`TEXTGEN_CPU_ARCH`);
- torch is held to its AVX2 kernels (`ATEN_CPU_CAPABILITY=avx2`);
- every test that checks an op against its torch code runs there, and the engines' oracle tests (greedy tokens
  equal to transformers', padded and paged, float32 and bfloat16).
On a machine without AVX-512 the suite's own build is that build: the sources choose their paths by
`__AVX512F__`, `__AVX512BF16__`, `__AVX512VNNI__`, `__AVX512VBMI__`, `__AVX2__` and `__FMA__` alone, which
-march=native there defines as x86-64-v3 does, and torch runs its AVX2 kernels by itself. (On AVX-512, VNNI and VBMI
pick int4_gemv's integer blocks of torch's AVX-512 layout; the float blocks they replace still run there for a row
the integer path declines, which test_int4_gemv.py checks.) The test then checks that this process is on those
paths, and the suite's own run of the same tests is the AVX2 run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from textgen_server.layers.cpu_ops import (
    ARCH_ENV,
    BUILT_STAMP,
    ENV_SWITCH,
    HEADERS,
    SOURCES,
    cpu_flags,
    kernel_available,
    library_name,
    torch_build_directory,
)

HERE = Path(__file__).parent
# What differs between the two builds: the ops, each against its torch oracle (whole files), and the engines'
# oracle tests that run them (greedy tokens equal to transformers', padded and paged, float32 and bfloat16, and
# the greedy op's bits). The engines' other tests run no op the native build's run does not already check.
AVX2_TESTS = (
    "test_fused_ops.py",
    "test_token_ops.py",
    "test_paged_attention.py",
    "test_decode_attention.py",
    "test_attention_kernels.py",
    "test_int4_gemv.py",
    "test_int8_gemv.py",
    "test_gemv.py::test_the_float32_op_sums_as_documented",
    "test_gemv.py::test_the_avx2_bfloat16_op_sums_in_torch_s_order",
    "test_gemv.py::test_the_avx2_bfloat16_op_refuses_runs_a_bias_and_bad_inputs",
    "test_attention_products.py",
    "test_paged_lm.py::test_uneven_batch_through_filter_and_concatenate_matches_transformers",
    "test_paged_lm.py::test_bfloat16_matches_transformers_eager",
    "test_causal_lm.py::test_llama_uneven_batch_matches_transformers",
    "test_causal_lm.py::test_bfloat16_llama_uneven_batch_matches_transformers_eager",
    "test_chooser.py::test_greedy_ids_and_logprobs_are_torch_s_bits_with_and_without_the_op",
)
AVX2_ENV = {ARCH_ENV: "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2", ENV_SWITCH: "1"}
# test_paged_attention.py's skip where the AVX2 build's bf16 prefill products are not torch's (an AVX-512 CPU).
POOL_SKIP = "bfloat16 prefill rows read the pool only through the ops of an AVX2 build"

# What the sources test (`#if defined(...)`): the architecture and six CPU features. The AVX2 paths are the ones
# compiled where the AVX-512 macros are not defined, whatever else -march enables.
SOURCE_MACROS = {
    *("__x86_64__", "__i386__", "__AVX2__", "__FMA__"),
    *("__AVX512F__", "__AVX512BF16__", "__AVX512VNNI__", "__AVX512VBMI__"),
}
# What x86-64-v3 code may use beyond AVX2 and FMA: a CPU (or a VM) without one of them would stop the build's
# process on an illegal instruction.
X86_64_V3 = {"avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}


needs_avx2 = pytest.mark.skipif(
    not X86_64_V3 <= cpu_flags(),
    reason="needs an x86 CPU that runs x86-64-v3 code (AVX2, FMA, BMI, ...)",
)


def compiler_knows(flag: str) -> bool:
    """Whether the compiler torch's extension builder runs (CXX, else c++) accepts `flag` (gcc before 11 and clang
    before 12 do not know -march=x86-64-v3)."""
    try:
        check = subprocess.run(
            [os.environ.get("CXX", "c++"), flag, "-x", "c++", "-E", "-"], input="", capture_output=True, timeout=60
        )
    except OSError:
        return False
    return check.returncode == 0


def run_with(env: dict[str, str], timeout: float, *args: str) -> subprocess.CompletedProcess[str]:
    """`python *args` in a process of its own (torch reads ATEN_CPU_CAPABILITY once, the library loads once)."""
    return subprocess.run(
        [sys.executable, *args],
        env={**os.environ, **env},
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def native_build_is_the_avx2_build() -> bool:
    """Whether this process's ops and torch are already the AVX2 build's: no AVX-512 here, and neither the target
    nor torch's capability set otherwise."""
    return (
        "avx512f" not in cpu_flags()
        and os.environ.get(ARCH_ENV, "native") == "native"
        and os.environ.get("ATEN_CPU_CAPABILITY", "avx2").lower() == "avx2"
    )


@needs_avx2
@pytest.mark.timeout(960)
def test_the_avx2_build_passes_the_op_and_oracle_tests() -> None:
    if not kernel_available():
        pytest.skip("no C++ compiler: the shard keeps its torch code")
    if not compiler_knows("-march=x86-64-v3"):
        pytest.skip("the compiler does not know -march=x86-64-v3")
    tested = {m for path in (*SOURCES, *HEADERS) for m in re.findall(r"defined\((__\w+__)\)", path.read_text())}
    assert tested <= SOURCE_MACROS, f"the sources now test {sorted(tested - SOURCE_MACROS)}: see the docstring"
    if native_build_is_the_avx2_build():
        assert torch.ops.textgen.greedy_pick_capability() == "AVX2"
        assert torch.backends.cpu.get_cpu_capability() == "AVX2"
        return
    # Built for AVX2, and torch on the same path: otherwise the tests below would check the AVX-512 build again.
    # The limits only stop a hang: the two processes take 15-40 s on a quiet 2-core box (the first builds the
    # library), but the second runs hundreds of tests, and on a loaded box it ran past a 150 s limit.
    probe = run_with(
        AVX2_ENV,
        300,
        "-c",
        "import torch; from textgen_server.layers.cpu_ops import kernel_available; assert kernel_available(); "
        "print(torch.ops.textgen.greedy_pick_capability(), torch.backends.cpu.get_cpu_capability())",
    )
    assert probe.returncode == 0, probe.stderr[-4000:]
    assert probe.stdout.split() == ["AVX2", "AVX2"]
    tests = run_with(AVX2_ENV, 600, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *AVX2_TESTS)
    summary = tests.stdout.strip().splitlines()[-1] if tests.stdout.strip() else ""
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert "passed" in summary, summary
    # The one skip an AVX-512 CPU makes here: torch multiplies bf16 through oneDNN whatever its capability, so the
    # AVX2 build's prefill products do not give torch's bits and the engine leaves them (reads_pool is False).
    skips = [line for line in tests.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all(POOL_SKIP in line for line in skips), skips


def kernel_available_with(env: dict[str, str], available: bool, timeout: float) -> subprocess.CompletedProcess[str]:
    """Asserts what `kernel_available()` answers in a process with `env`; returns that process (its log)."""
    probe = run_with(
        env, timeout, "-c", "from textgen_server.layers.cpu_ops import kernel_available; print(kernel_available())"
    )
    assert probe.returncode == 0, probe.stderr[-4000:]
    assert probe.stdout.split() == [str(available)]
    return probe


def test_a_target_that_is_not_a_march_name_is_refused() -> None:
    """The value becomes one compiler flag: anything but a -march name leaves the ops off, with a warning."""
    probe = kernel_available_with({ARCH_ENV: "native -O0"}, available=False, timeout=60)
    assert "TEXTGEN_CPU_ARCH='native -O0' is not a -march target" in probe.stderr


def finished_build() -> Path:
    """This process's finished library folder (native target), built by kernel_available() if need be."""
    if not kernel_available():
        pytest.skip("no C++ compiler: the shard keeps its torch code")
    directory = torch_build_directory(library_name(os.environ.get(ARCH_ENV, "native")))
    assert (directory / BUILT_STAMP).is_file()
    return directory


def test_a_finished_build_loads_though_a_killed_build_left_its_lock(tmp_path: Path) -> None:
    """torch's builder waits for ever on a lock file that a process killed mid-build left; a library it finished
    is loaded without it (and without ninja), so such a lock blocks no later start."""
    built = finished_build()
    shutil.copytree(built, tmp_path / built.name)
    (tmp_path / built.name / "lock").write_text("")
    kernel_available_with({"TORCH_EXTENSIONS_DIR": str(tmp_path)}, available=True, timeout=120)


def test_an_unwritable_extensions_dir_falls_back_to_the_temporary_one(tmp_path: Path) -> None:
    """A TORCH_EXTENSIONS_DIR that cannot be written (a read-only Docker volume; here a path under a file, which
    no one can create, root included) still gets the ops, from a folder under the temporary directory, with a
    warning. That folder is seeded with the finished library, as an earlier start would have left it: building it
    there is what every first start does, and costs a minute here."""
    built = finished_build()
    blocker = tmp_path / "volume"
    blocker.write_text("")
    temporary = tmp_path / "tmp"
    shutil.copytree(built, temporary / "textgen_torch_extensions" / built.name)
    probe = kernel_available_with(
        {"TORCH_EXTENSIONS_DIR": str(blocker / "torch_extensions"), "TMPDIR": str(temporary)},
        available=True,
        timeout=120,
    )
    assert "TORCH_EXTENSIONS_DIR cannot be written" in probe.stderr
    assert str(temporary / "textgen_torch_extensions") in probe.stderr


def test_an_installed_package_carries_every_source_of_the_ops() -> None:
    # A non-editable install holds only what package-data lists: a missing header made the library's name (a hash
    # of every source) raise, and the shard stop, instead of building the ops.
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((HERE.parents[1] / "pyproject.toml").read_text())
    globs = project["tool"]["setuptools"]["package-data"]["textgen_server"]
    package = HERE.parent / "textgen_server"
    shipped = {path for pattern in globs for path in package.glob(pattern)}
    assert set(SOURCES) | set(HEADERS) <= shipped
