"""CPU kernels chosen per projection shape and bucket of rows (layers/linear_choice.py).

Oracles: torch's profiler for the dispatch (each path runs an op of its own: aten::addmm, mkl::_mkl_linear,
mkldnn::_linear_pointwise; their float32 bits can coincide on a CPU, so the bits cannot tell which one ran);
`F.linear` for what a chosen layer computes (bfloat16 bit for bit, float32 within
its tolerance); transformers' greedy tokens for real shard processes started with each TEXTGEN_CPU_LINEAR.
"""

from __future__ import annotations

import logging
import math
import platform
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from shard_helpers import HFOracle, generate_over_grpc, make_batch, make_request

from testing.shards import ShardHandle
from textgen_common import cache_dir
from textgen_server.config import ServeConfig, UnsupportedConfigError
from textgen_server.layers import cpu_ops, linear_choice, measurements
from textgen_server.layers.linear_choice import (
    BUCKET_ROWS,
    ENV,
    KERNELS,
    MARGIN,
    available_paths,
    bucket,
    choose,
    choose_linear_kernels,
)
from textgen_server.layers.tensor_parallel import Linear
from textgen_server.loader import get_model
from textgen_server.utils import cgroup

CPU = torch.device("cpu")
FP32_PATHS = available_paths(torch.float32, CPU)
needs_all_fp32_paths = pytest.mark.skipif(
    not {"linear", "mkl", "onednn"} <= set(FP32_PATHS), reason=f"this torch has only {FP32_PATHS} for float32"
)
needs_onednn_bf16 = pytest.mark.skipif(
    "onednn" not in available_paths(torch.bfloat16, CPU), reason="no native oneDNN bfloat16 kernels here"
)
ROWS = [0, 1, 2, 8, 9, 64, 65, 300]
LOGGER = "textgen_server.layers.linear_choice"


@pytest.fixture(autouse=True)
def own_measurements(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test measures into a folder of its own (TEXTGEN_CACHE_DIR, layers/measurements.py): the figures some
    tests fake, or a shape another test measured, never reach another test or a shard of the session."""
    monkeypatch.setenv(cache_dir.ENV, str(tmp_path / "measurements"))
    return tmp_path / "measurements"


def test_buckets_split_at_1_8_and_64_rows() -> None:
    assert [bucket(r) for r in (0, 1, 2, 8, 9, 64, 65, 4096)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [bucket(r) for r in BUCKET_ROWS] == [0, 1, 2, 3]


def test_choose_keeps_one_main_path_unless_another_is_clearly_faster() -> None:
    # One path fastest everywhere: it serves every bucket.
    assert choose({"linear": [2, 2, 2, 2], "mkl": [1, 1, 1, 1]}) == ("mkl",) * 4
    # The main path (least relative time overall) is within MARGIN at 1 row: no second layout for that.
    near = 1 + MARGIN / 2
    assert choose({"linear": [1, 2, 2, 2], "mkl": [near, 1, 1, 1]}) == ("mkl",) * 4
    # Beyond MARGIN the faster path takes the bucket.
    far = 1 + MARGIN * 2
    assert choose({"linear": [1, 2, 2, 2], "mkl": [far, 1, 1, 1]}) == ("linear", "mkl", "mkl", "mkl")
    # Three layouts when each path wins its own bucket by far.
    times = {"linear": [1, 3, 3, 1], "mkl": [3, 1, 3, 3], "onednn": [3, 3, 1, 3]}
    assert choose(times) == ("linear", "mkl", "onednn", "linear")


# The op each path's kernel runs, as torch's profiler names it.
PATH_OPS = {"linear": "aten::addmm", "mkl": "mkl::_mkl_linear", "onednn": "mkldnn::_linear_pointwise"}


def paths_run(fn: Callable[[], torch.Tensor]) -> set[str]:
    """The linear paths whose ops `fn` ran."""
    with torch.profiler.profile() as prof:
        fn()
    names = {event.name for event in prof.events()}
    return {path for path, op in PATH_OPS.items() if op in names}


@needs_all_fp32_paths
@pytest.mark.parametrize(
    "paths", [("mkl", "linear", "onednn", "linear"), ("onednn", "mkl", "linear", "mkl"), ("linear",) * 4]
)
def test_each_row_count_runs_its_buckets_kernel(paths: tuple[str, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(768, 2048, generator=g), torch.randn(768, generator=g)
    layer = Linear(weight.clone(), bias.clone())
    layer.use(paths)
    # Only the layouts some bucket reads are kept.
    assert {k.path for k in layer.kernels} == set(paths)
    assert (layer.weight is not None) == ("linear" in paths)
    for rows in ROWS[1:]:
        x = torch.randn(rows, 2048, generator=g)
        expected = paths[bucket(rows)]
        assert paths_run(lambda x=x: layer(x)) == {expected}, f"{rows} rows: not {expected}"
        assert torch.equal(layer(x), KERNELS[expected](weight, bias)(x)), f"{rows} rows: not {expected}'s output"
    assert layer(torch.randn(0, 2048)).shape == (0, 768)


def layers_of(shapes: list[tuple[int, int]], dtype: torch.dtype) -> list[Linear]:
    g = torch.Generator().manual_seed(1)
    return [
        Linear(torch.randn(shape, generator=g).to(dtype), torch.randn(shape[0], generator=g).to(dtype))
        for shape in shapes
    ]


def plain_copies(layers: list[Linear]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    copies = []
    for layer in layers:
        assert layer.bias is not None
        copies.append((layer.plain_weight().clone(), layer.bias.detach().clone()))
    return copies


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, pytest.param(torch.bfloat16, marks=needs_onednn_bf16)],
    ids=["float32", "bfloat16"],
)
def test_auto_measures_each_shape_once_and_computes_what_f_linear_does(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    layers = layers_of([(96, 256), (40, 24), (96, 256), (96, 256), (40, 24)], dtype)
    plain = plain_copies(layers)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        choose_linear_kernels(layers)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 2, lines  # one per distinct shape
    assert "96x256" in lines[0] and "(3 layers)" in lines[0] and "measured" in lines[0]
    assert "40x24" in lines[1] and "(2 layers)" in lines[1]
    # Every layer of a shape takes the choice measured on the first one.
    assert layers[0].paths == layers[2].paths == layers[3].paths and layers[1].paths == layers[4].paths
    g = torch.Generator().manual_seed(2)
    for layer, (weight, bias) in zip(layers, plain, strict=True):
        assert {k.path for k in layer.kernels} == set(layer.paths)
        assert (layer.weight is not None) == ("linear" in layer.paths)
        for rows in ROWS:
            x = torch.randn(rows, weight.shape[1], generator=g).to(dtype)
            out, reference = layer(x), F.linear(x, weight, bias)
            if dtype == torch.bfloat16:
                assert torch.equal(out, reference), f"{rows} rows on {layer.paths[bucket(rows)]}"
            else:
                torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("forced", ["linear", "mkl", "onednn"])
def test_the_environment_forces_one_path_for_every_bucket(
    forced: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ENV, forced)
    fp32, fp16 = layers_of([(96, 256)], torch.float32), layers_of([(96, 256)], torch.float16)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        choose_linear_kernels(fp32 + fp16)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 2 and all(f"{ENV}={forced}" in line for line in lines), lines
    expected = forced if forced in FP32_PATHS else "linear"
    assert fp32[0].paths == (expected,) * len(BUCKET_ROWS)
    # No packed path exists for float16: F.linear serves, and the log line says why.
    assert fp16[0].paths == ("linear",) * len(BUCKET_ROWS)
    assert forced == "linear" or f"no {forced} path here" in lines[1]


def test_an_unknown_value_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "fastest")
    with pytest.raises(
        UnsupportedConfigError, match=f"{ENV}='fastest': expected one of auto, linear, mkl, onednn, gemv"
    ):
        choose_linear_kernels(layers_of([(8, 6)], torch.float32))


def test_a_later_start_reads_the_times_and_measures_nothing(
    own_measurements: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The times of each shape are kept per CPU and torch; the next choice of the same shapes (a restarted shard:
    here the process's cache of the file is dropped) reads them instead of timing every path again."""
    monkeypatch.delenv(ENV, raising=False)
    timed: list[tuple[int, ...]] = []
    real = linear_choice.time_paths

    def counting(weight: torch.Tensor, bias: torch.Tensor | None, paths: list[str]) -> dict[str, list[float]]:
        timed.append(tuple(weight.shape))
        return real(weight, bias, paths)

    monkeypatch.setattr(linear_choice, "time_paths", counting)
    first = layers_of([(96, 256), (40, 24)], torch.float32)
    choose_linear_kernels(first)
    assert timed == [(96, 256), (40, 24)] and len(list(own_measurements.glob("cpu-measurements-*.json"))) == 1
    measurements._measurements_at.cache_clear()
    again = layers_of([(96, 256), (40, 24), (40, 24)], torch.float32)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        choose_linear_kernels(again)
    assert len(timed) == 2, timed
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 2 and all("measured at an earlier start" in line for line in lines), lines
    assert [layer.paths for layer in again[:2]] == [layer.paths for layer in first]


def test_another_cpu_torch_or_kernel_code_measures_anew(
    own_measurements: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    here = measurements.cache_file(32 * 2**20)
    assert here is not None and here.parent == own_measurements
    assert measurements.cache_file(16 * 2**20) != here
    real_name = measurements.cpu_model_name
    monkeypatch.setattr(measurements, "cpu_model_name", lambda: "another CPU")
    assert measurements.cache_file(32 * 2**20) != here
    monkeypatch.setattr(measurements, "cpu_model_name", real_name)
    assert measurements.cache_file(32 * 2**20) == here
    # A kernel's code changed (what it serves, how fast it runs): its kept times would mislead the choice.
    code = measurements.KERNEL_CODE
    edited = tmp_path / "linear_choice.py"
    edited.write_text(code[-2].read_text() + "# edited\n")
    monkeypatch.setattr(measurements, "KERNEL_CODE", (*code[:-2], edited, code[-1]))
    measurements.kernels_tag.cache_clear()
    assert measurements.cache_file(32 * 2**20) != here
    monkeypatch.setattr(measurements, "KERNEL_CODE", code)
    measurements.kernels_tag.cache_clear()
    assert measurements.cache_file(32 * 2**20) == here
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    other = measurements.cache_file(32 * 2**20)
    assert other is not None and other.parent == own_measurements and other != here


def test_an_empty_cache_dir_keeps_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv(cache_dir.ENV, "")
    monkeypatch.chdir(tmp_path)
    assert measurements.cache_file(32 * 2**20) is None
    choose_linear_kernels(layers_of([(8, 6)], torch.float32))
    assert list(tmp_path.iterdir()) == []


PROMPTS = ["def foo(x):", "import os\nimport sys\n", "while True:"]
NEW_TOKENS = 6


def greedy_tokens(handle: ShardHandle) -> list[list[int]]:
    """Prefill the prompts in one batch (decode rows then: 3, prefill rows: 3 x prompt length), decode to the
    end; each request's tokens."""
    batch = make_batch(1, [make_request(i, p, NEW_TOKENS) for i, p in enumerate(PROMPTS)])
    tokens = generate_over_grpc(handle.stub(), batch)
    return [tokens[i] for i in range(len(PROMPTS))]


@pytest.mark.parametrize(
    "dtype, forced",
    [
        ("float32", "auto"),
        ("float32", "linear"),
        ("float32", "mkl"),
        ("float32", "onednn"),
        ("bfloat16", "auto"),
        ("bfloat16", "gemv"),
    ],
)
def test_a_shard_started_with_each_override_matches_transformers(
    dtype: str, forced: str, tiny_llama: Path, start_shard: Callable[..., ShardHandle]
) -> None:
    handle = start_shard(tiny_llama, env={ENV: forced}, extra_args=["--dtype", dtype])
    oracle = HFOracle(tiny_llama, dtype=dtype)
    assert greedy_tokens(handle) == [oracle.greedy(p, NEW_TOKENS) for p in PROMPTS]
    log = handle.log_text()
    assert "CPU linear" in log and (forced == "auto" or f"{ENV}={forced}" in log), log
    # The counterpart of the DISABLE_CUSTOM_KERNELS test below: a shard loads the ops wherever they build.
    assert cpu_ops_loaded(handle) == cpu_ops.kernel_available()


def cpu_ops_loaded(handle: ShardHandle) -> bool:
    """Whether the shard process has loaded the library of textgen's C++ CPU ops (layers/cpu_ops.py names it
    textgen_cpu_ops_*): whether any of them could have run there."""
    maps = Path(f"/proc/{handle.process.pid}/maps")
    if not maps.exists():
        pytest.skip("no /proc: the process's loaded libraries cannot be listed here")
    return "textgen_cpu_ops_" in maps.read_text()


def test_a_shard_with_custom_kernels_disabled_runs_torch_ops_only(
    tiny_llama: Path, start_shard: Callable[..., ShardHandle]
) -> None:
    """DISABLE_CUSTOM_KERNELS=True, as textgen-launcher --disable-custom-kernels sets it: the shard never loads the
    C++ ops (decode attention, fused small ops, greedy pick, gemv), keeps F.linear for every projection without
    timing any path, and still gives transformers' tokens (bfloat16: the dtype with the most ops)."""
    handle = start_shard(tiny_llama, env={"DISABLE_CUSTOM_KERNELS": "True"}, extra_args=["--dtype", "bfloat16"])
    oracle = HFOracle(tiny_llama, "bfloat16", "eager")
    assert greedy_tokens(handle) == [oracle.greedy(p, NEW_TOKENS) for p in PROMPTS]
    assert not cpu_ops_loaded(handle)
    lines = [line for line in handle.log_text().splitlines() if "CPU linear" in line]
    assert len(lines) == 1 and lines[0].endswith("CPU linear: F.linear everywhere (DISABLE_CUSTOM_KERNELS)"), lines


@pytest.mark.parametrize(
    ("dtype", "native_bf16", "warned"),
    [("bfloat16", False, True), ("bfloat16", True, False), ("float32", False, False)],
)
def test_bfloat16_without_native_hardware_is_warned_about(
    tiny_llama: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    dtype: str,
    native_bf16: bool,
    warned: bool,
) -> None:
    """On an x86 CPU without AVX512-BF16 or AMX, bf16 decodes slower than float32 (benchmark/README.md): the
    shard loads it as asked and says so once."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the flags are x86's")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: native_bf16)
    with caplog.at_level(logging.WARNING, logger="textgen_server.loader"):
        model = get_model(ServeConfig(str(tiny_llama), dtype=dtype))
    assert model.config.dtype == getattr(torch, dtype)
    lines = [r.getMessage() for r in caplog.records if "without AVX512-BF16 or AMX" in r.getMessage()]
    assert len(lines) == (1 if warned else 0)


@pytest.mark.parametrize(("available", "kept"), [(2**40, ("linear", "mkl", "mkl", "mkl")), (2**20, ("mkl",) * 4)])
@needs_all_fp32_paths
def test_second_layouts_are_kept_only_within_their_share_of_memory(
    available: int,
    kept: tuple[str, ...],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Times fixed so that `linear` wins one row by far and MKL the rest (a choice of two layouts); with memory
    to spare both are kept, with less than the layouts need only the main path is."""
    monkeypatch.delenv(ENV, raising=False)
    slow = [4.0, math.inf, math.inf, math.inf]  # the one-row gemv, where this CPU has it
    times = {"linear": [1.0, 3.0, 3.0, 3.0], "mkl": [2.0, 1.0, 1.0, 1.0], "onednn": [4.0] * 4, "gemv": slow}
    monkeypatch.setattr(linear_choice, "time_paths", lambda weight, bias, paths: {p: times[p] for p in paths})
    monkeypatch.setattr(cgroup, "available_memory", lambda: available)
    layers = layers_of([(256, 512), (256, 512)], torch.float32)  # 1 MiB of float32 weights in all
    with caplog.at_level(logging.INFO, logger=LOGGER):
        choose_linear_kernels(layers)
    assert all(layer.paths == kept for layer in layers)
    assert {k.path for k in layers[0].kernels} == set(kept)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == (0 if len(set(kept)) > 1 else 1), warned
    assert all("1 MiB of second weight layouts" in line for line in warned)
