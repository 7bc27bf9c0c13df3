"""GPTQ and AWQ checkpoints (`--quantize gptq | awq`): what is read, what is refused, and the tokens served.

The oracle is transformers on the checkpoint dequantized by `testing.dequantize` (its own unpacking of the
published layouts, checked against hand-packed words in test_quant_builder.py), never by textgen's code. float32
shards dequantize at load and must give the oracle's logits; bfloat16 shards run the int4 kernel on the packed
weights and must stay within a stated distance of them.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from shard_helpers import HFOracle, check_decode_paths, chooser, generate_on_ranks, make_request, quantized_logits
from transformers import AutoConfig, AutoTokenizer

from testing.models import build_dequantized_oracle, build_int8_oracle, build_quantized_model
from testing.shards import ShardProcess
from textgen_pb import generate_pb2 as pb
from textgen_server.config import DISABLE_CUSTOM_KERNELS, ServeConfig, UnsupportedConfigError
from textgen_server.layers import cpu_ops, quant_kernels
from textgen_server.layers.linear_choice import KERNELS
from textgen_server.layers.quant_kernels import (
    DEQUANTIZE_ROWS,
    EVERY_COUNT,
    GEMV_ROWS,
    Int4Kernel,
    Int8Kernel,
    packed_kernel,
)
from textgen_server.layers.quantization import REFUSED, read_quant_config
from textgen_server.layers.quantized_weight import QuantizedWeight
from textgen_server.layers.tensor_parallel import Linear
from textgen_server.loader import get_model
from textgen_server.models.kv_pool import POOL_TOKENS_ENV
from textgen_server.models.paged_lm import PagedCausalLM
from textgen_server.models.tp_llama import load_tp_model
from textgen_server.utils.dist import DistInfo

VARIANTS = {
    "gptq-4bit": {"method": "gptq"},
    "gptq-4bit-asym": {"method": "gptq", "sym": False},
    "gptq-4bit-act-order": {"method": "gptq", "desc_act": True},
    "gptq-8bit": {"method": "gptq", "bits": 8},
    "awq-4bit": {"method": "awq"},
    "gptq-4bit-lm-head": {"method": "gptq", "lm_head": True},  # GPTQModel's lm_head: the head quantized too
}
PROMPT = [1, 5, 9, 100, 200, 300, 7, 42]
# bfloat16 activations against the float32 oracle: the tiny model's float weights in bfloat16 are 0.13-0.16 apart
# (max over positions and vocabulary of |log-softmax difference|); the int4 kernel's bf16 scales add a little.
BF16_LOGPROB_TOLERANCE = 0.3
PHONE = r"[0-9]{3}-[a-z]{2,4}"


def _config_dir(tmp_path: Path, quantization: dict[str, object] | None, **files: dict[str, object]) -> Path:
    tmp_path.mkdir(exist_ok=True)
    config: dict[str, object] = {"model_type": "llama"}
    if quantization is not None:
        config["quantization_config"] = quantization
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name, content in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    return tmp_path


def _read(model_dir: Path, requested: str | None) -> object:
    return read_quant_config(model_dir, json.loads((model_dir / "config.json").read_text()), requested)


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_quantizations_not_served_on_a_cpu_are_refused_naming_them(flag: str, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedConfigError, match=re.escape(f"--quantize {flag} is not supported: {REFUSED[flag]}")):
        _read(_config_dir(tmp_path, None), flag)


@pytest.mark.parametrize(
    "quantization, requested, message",
    [
        (None, "gptq", "--quantize gptq needs a checkpoint quantized with gptq"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 32}, "awq", "--quantize awq was given for a checkpoint"),
        ({"quant_method": "bitsandbytes"}, None, r"the checkpoint's quantization \(bitsandbytes\) is not supported"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, None, "AWQ checkpoint"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 32}, None, "GPTQ checkpoint"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"}, None, "GPTQ"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 0}, None, "group_size 0 is not supported"),
        (None, "eetq", None),  # quantized at load from a float checkpoint: accepted
        ({"quant_method": "awq", "bits": 4, "group_size": 32}, "eetq", "quantizes float weights at load; this"),
    ],
)
def test_checkpoints_and_flags_are_checked_against_each_other(
    quantization: dict[str, object] | None, requested: str | None, message: str | None, tmp_path: Path
) -> None:
    if message is None:
        assert _read(_config_dir(tmp_path, quantization), requested) is not None
        return
    with pytest.raises(UnsupportedConfigError, match=message):
        _read(_config_dir(tmp_path, quantization), requested)


def test_the_quantization_is_read_from_the_config_or_the_files_beside_it(tmp_path: Path) -> None:
    assert _read(_config_dir(tmp_path / "f", None), None) is None  # a float checkpoint served as is
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False}
    read = _read(_config_dir(tmp_path / "c", gptq), "gptq")
    assert (read.method, read.bits, read.group_size, read.desc_act, read.sym) == ("gptq", 4, 128, True, False)
    old = _config_dir(tmp_path / "o", None, quantize_config={"bits": 8, "group_size": 64})  # AutoGPTQ's own file
    assert (_read(old, None).method, _read(old, None).bits) == ("gptq", 8)
    awq = _config_dir(tmp_path / "a", None, quant_config={"w_bit": 4, "q_group_size": 64, "zero_point": True})
    assert (_read(awq, None).method, _read(awq, None).group_size) == ("awq", 64)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def quantized(request: pytest.FixtureRequest) -> tuple[str, Path, Path]:
    """(the variant's name, the quantized tiny llama, its dequantized float32 oracle)."""
    qdir = build_quantized_model(**VARIANTS[request.param])
    return request.param, qdir, build_dequantized_oracle(qdir)


def test_float32_shards_compute_the_dequantized_checkpoint(quantized: tuple[str, Path, Path]) -> None:
    _, qdir, oracle = quantized
    want = HFOracle(oracle).model(torch.tensor([PROMPT])).logits[0].float().detach()
    got, linears = quantized_logits(qdir, torch.float32, PROMPT)
    assert torch.allclose(got, want, atol=1e-4, rtol=0)
    # the packed kernels' float32 paths are slow: float32 shards compute on the weights dequantized at load
    assert all(m.packed is None and m.dequantized and "float32 activations" in m.dequantized for m in linears[:-1])


def test_bfloat16_shards_keep_4_bit_weights_packed(quantized: tuple[str, Path, Path]) -> None:
    variant, qdir, oracle = quantized
    want = torch.log_softmax(HFOracle(oracle).model(torch.tensor([PROMPT])).logits[0].float().detach(), -1)
    got, linears = quantized_logits(qdir, torch.bfloat16, PROMPT)
    assert (torch.log_softmax(got, -1) - want).abs().max() < BF16_LOGPROB_TOLERANCE
    head = linears[-1]
    projections = linears if VARIANTS[variant].get("lm_head") else linears[:-1]
    if not VARIANTS[variant].get("lm_head"):  # the LM head stays a float weight unless the checkpoint quantized it
        # (kept as loaded, or only in the float layouts of the paths chosen for it: `gemv` alone on an AVX2 CPU)
        assert head.packed is None and head.dequantized is None
        assert set(head.paths) <= set(KERNELS)
    if VARIANTS[variant].get("bits", 4) == 4:
        assert all(isinstance(m.packed, Int4Kernel) and m.weight is None for m in projections)
    else:
        assert all(m.packed is None and m.dequantized and "8-bit groups" in m.dequantized for m in projections)


def _weight(n: int, k: int, group: int, act_order: bool, dtype: torch.dtype) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(n * k + group)
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return QuantizedWeight(
        torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
        torch.randint(0, 16, (n, k // group), generator=gen).to(dtype),
        (torch.rand(n, k // group, generator=gen) / 50 + 0.001).to(dtype),
        g_idx,
        4,
        group,
    )


@pytest.mark.parametrize("act_order", [False, True])
def test_the_int4_kernel_computes_the_dequantized_product(act_order: bool) -> None:
    weight = _weight(48, 128, 32, act_order, torch.bfloat16)
    bias = torch.randn(48, dtype=torch.bfloat16)
    x = torch.randn(3, 5, 128, dtype=torch.bfloat16)
    want = x.float() @ weight.dequantize().float().t() + bias.float()
    got = Int4Kernel(weight, bias)(x)
    assert got.shape == (3, 5, 48) and got.dtype == torch.bfloat16
    # bf16 output and bf16 scale/offset products: a few bf16 ulps of the outputs' size
    assert (got.float() - want).abs().max() < 0.02 * want.abs().max()


def test_weights_no_packed_kernel_reads_say_why() -> None:
    def why(weight: QuantizedWeight) -> object:
        kernel = packed_kernel(weight, None)
        return kernel if isinstance(kernel, str) else type(kernel).__name__

    assert why(_weight(48, 128, 32, False, torch.float32)) == (
        "torch.float32 activations (the int4 kernel runs bfloat16 only at speed)"
    )
    assert why(_weight(40, 128, 32, False, torch.bfloat16)) == "shape 40x128 with groups of 32"
    uneven = _weight(48, 128, 32, True, torch.bfloat16).cols(0, 64)  # a rank's half of scattered groups
    assert why(uneven) == "act-order groups of unequal sizes in this shard's input features"
    assert why(_weight(48, 256, 256, False, torch.bfloat16).cols(0, 128)) == "Int4Kernel"  # per channel, split
    assert why(QuantizedWeight.per_channel_int8(torch.randn(48, 128).bfloat16())) == "Int8Kernel"
    assert why(QuantizedWeight.per_channel_int8(torch.randn(48, 128))) == (
        "torch.float32 activations (the int8 kernel runs bfloat16 only at speed)"
    )
    grouped = _weight(48, 128, 32, False, torch.bfloat16)
    grouped.bits = 8
    assert why(grouped) == "8-bit groups (the int8 kernel takes one scale per output feature)"


@pytest.mark.skipif(not cpu_ops.kernel_available(), reason="the switch is timed where the CPU ops are on")
@pytest.mark.parametrize("kernel", [Int4Kernel, Int8Kernel])
def test_the_many_row_switch_is_measured_once_per_shape(
    kernel: type[Int4Kernel | Int8Kernel], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(DISABLE_CUSTOM_KERNELS, raising=False)
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "1")
    if kernel is Int4Kernel:
        weight = _weight(112, 256, 128, act_order=True, dtype=torch.bfloat16)
    else:
        weight = QuantizedWeight.per_channel_int8(
            torch.randn(96, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
        )
    built = kernel(weight, None)
    first = built.dequantize_from
    assert first in (*DEQUANTIZE_ROWS, None)
    few = built.gemv_until if isinstance(built, Int4Kernel) else None
    assert few is None or few in (1, *GEMV_ROWS, EVERY_COUNT)
    # A second kernel of the shape reads the kept figures (and so does the next start: layers/measurements.py).
    monkeypatch.setattr(quant_kernels, "least_seconds", lambda *args: pytest.fail("measured again"))
    again = kernel(weight, None)
    assert again.dequantize_from == first
    assert not isinstance(again, Int4Kernel) or again.gemv_until == few


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_channel_int8_rounds_to_nearest(dtype: torch.dtype) -> None:
    float_weight = torch.randn(48, 128).to(dtype).float()
    weight = QuantizedWeight.per_channel_int8(float_weight.to(dtype))
    dequantized = weight.dequantize().float()
    # Within half a step of each row's scale (round to nearest), plus the rounding of the product to `dtype`.
    rounding = float_weight.abs() * torch.finfo(dtype).eps
    assert ((dequantized - float_weight).abs() <= weight.scales.float() / 2 + rounding).all()


def test_the_int8_kernel_computes_the_per_channel_product() -> None:
    weight = QuantizedWeight.per_channel_int8(torch.randn(48, 128).bfloat16())
    dequantized = weight.dequantize().float()
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    got = Int8Kernel(weight, None)(x)
    want = x.float() @ dequantized.t()
    assert got.shape == (2, 3, 48) and (got.float() - want).abs().max() < 0.02 * want.abs().max()


def test_a_quantized_checkpoint_is_detected_and_served_in_bfloat16(caplog: pytest.LogCaptureFixture) -> None:
    qdir = build_quantized_model("gptq")
    with caplog.at_level(logging.INFO):
        model = get_model(ServeConfig(model_id=str(qdir)))  # no --quantize: the config says it
    assert model.config.dtype == torch.bfloat16  # TGI's CPU default for quantized weights
    assert any("GPTQ 4-bit (groups of 32): 8 projections on the int4 kernel" in m for m in caplog.messages)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eetq_quantizes_the_projections_to_int8_at_load(tiny_llama: Path, dtype: torch.dtype) -> None:
    ids = torch.tensor([PROMPT])
    want = HFOracle(build_int8_oracle(tiny_llama)).model(ids).logits[0].float().detach()
    got, linears = quantized_logits(tiny_llama, dtype, PROMPT, "eetq")
    if dtype == torch.bfloat16:
        assert all(isinstance(m.packed, Int8Kernel) and m.weight is None for m in linears[:-1])
    else:  # the int8 kernel's float32 path is slow: the same integers, dequantized at load
        assert all(m.packed is None and m.dequantized and "float32" in m.dequantized for m in linears[:-1])
    assert linears[-1].packed is None  # the LM head stays float, as in TGI
    if dtype == torch.float32:
        assert torch.allclose(got, want, atol=1e-4, rtol=0)
    else:
        logprobs = torch.log_softmax(got, -1) - torch.log_softmax(want, -1)
        assert logprobs.abs().max() < BF16_LOGPROB_TOLERANCE


@pytest.mark.parametrize("scheme", ["gptq", "eetq"])
def test_quantized_decode_steps_through_the_blocks_give_the_module_path_s_bits(
    scheme: str, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The int4 and int8 one-row kernels are ops the C++ decode blocks call: a batch-1 step goes through them."""
    if not cpu_ops.kernel_available():
        pytest.skip("the C++ ops do not build here: every step takes the modules' forward")
    model_dir, flag = (build_quantized_model("gptq"), None) if scheme == "gptq" else (tiny_llama, "eetq")
    monkeypatch.setenv(POOL_TOKENS_ENV, "4096")
    model = get_model(ServeConfig(str(model_dir), dtype="bfloat16", quantize=flag))
    assert isinstance(model, PagedCausalLM)
    kernels = {type(m.packed) for m in model.module.modules() if isinstance(m, Linear) and m.packed is not None}
    assert kernels == {Int4Kernel if scheme == "gptq" else Int8Kernel}
    check_decode_paths(model, 1)


@pytest.mark.parametrize("scheme", ["gptq-act-order", "gptq-lm-head", "eetq"])
def test_one_and_two_quantized_shards_generate_the_oracles_greedy_tokens(scheme: str, tiny_llama: Path) -> None:
    if scheme == "eetq":
        model_dir, oracle_dir, flags = tiny_llama, build_int8_oracle(tiny_llama), ["--quantize", "eetq"]
    else:
        # a quantized head is split by vocabulary rows across the two ranks, its blocks gathered
        model_dir = build_quantized_model("gptq", desc_act=scheme == "gptq-act-order", lm_head=scheme == "gptq-lm-head")
        oracle_dir, flags = build_dequantized_oracle(model_dir), []  # detected from the checkpoint's config
    oracle = HFOracle(oracle_dir)
    prompts = ["def fill(self, text):", "The quick brown"]
    requests = [make_request(i, text, 8, ignore_eos=False) for i, text in enumerate(prompts)]
    want = {i: oracle.greedy(text, 8) for i, text in enumerate(prompts)}
    for ranks in (1, 2):
        with ShardProcess(model_dir, num_shard=ranks, extra_args=["--dtype", "float32", *flags]) as handle:
            assert generate_on_ranks(handle, requests)[0] == want, f"{ranks} shard(s)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_adapters_run_on_a_quantized_base(tmp_path: Path, dtype: torch.dtype) -> None:
    """peft on the dequantized oracle with the same adapter file is the reference."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from textgen_common.lora_adapters import parse_lora_adapters
    from textgen_server.adapters import load_adapters
    from textgen_server.builder import build_test_adapter

    qdir = build_quantized_model("gptq")
    oracle_dir = build_dequantized_oracle(qdir)
    adapter = build_test_adapter(tmp_path / "adapter", oracle_dir, seed=1)
    ids = torch.tensor([PROMPT, PROMPT])
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(oracle_dir), adapter).eval()
    with torch.inference_mode():
        want = torch.log_softmax(reference(ids[:1]).logits[0].float(), -1)
    config = AutoConfig.from_pretrained(qdir)
    quant = read_quant_config(qdir, json.loads((qdir / "config.json").read_text()), None)
    model = load_tp_model(qdir, config, dtype, torch.device("cpu"), DistInfo(0, 1, None), quant)
    load_adapters(model, parse_lora_adapters(f"one={adapter}"), config, DistInfo(0, 1, None))
    positions = torch.arange(len(PROMPT))[None].expand(2, -1)
    with torch.inference_mode():
        # row 0 on the adapter, row 1 on the base model: the delta reaches only its row
        out = model(ids, torch.ones_like(ids), positions, model.new_cache(), adapter_indices=[1, 0])
    got, base = (torch.log_softmax(out.logits[row].float(), -1) for row in (0, 1))
    tolerance = 1e-4 if dtype == torch.float32 else BF16_LOGPROB_TOLERANCE
    assert (got - want).abs().max() < tolerance
    assert (got - base).abs().max() > 10 * tolerance  # the adapter really changed row 0


def test_speculation_and_grammars_run_on_quantized_weights() -> None:
    """The decode features that do not touch the weights work on them: n-gram speculation (verifying several
    tokens a step through the same projections) emits the plain shard's tokens, and a regex grammar holds."""
    qdir = build_quantized_model("gptq")
    prompts = ["def fill(self, text):", "The quick brown fox jumps over the quick brown fox jumps over the"]
    plain_requests = [make_request(i, text, 10) for i, text in enumerate(prompts)]
    ruled = make_request(
        9, "Answer:", 12, ignore_eos=False, params=chooser(grammar=PHONE, grammar_type=pb.GRAMMAR_TYPE_REGEX)
    )
    with (
        ShardProcess(qdir, extra_args=["--dtype", "float32"]) as plain,
        ShardProcess(qdir, extra_args=["--dtype", "float32", "--speculate", "2"]) as guessing,
    ):
        want, _ = generate_on_ranks(plain, plain_requests)
        got, _ = generate_on_ranks(guessing, plain_requests)
        assert got == want
        tokens, _ = generate_on_ranks(guessing, [ruled])
    text = AutoTokenizer.from_pretrained(qdir).decode(tokens[9], skip_special_tokens=True)
    assert re.fullmatch(PHONE, text), text
