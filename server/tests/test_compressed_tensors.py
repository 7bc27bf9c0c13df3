"""compressed-tensors checkpoints (W4A16, W8A16 pack-quantized; W8A8 int-quantized) on the shards.

The checkpoints are written by the compressed-tensors package itself (`textgen_server.ct_builder`), and the oracle
is transformers running them through its compressed-tensors integration (`testing.ct_oracle`): the package's own
decompression and, for W8A8, its own per-token activation quantization.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from shard_helpers import generate_on_ranks, make_request, quantized_logits
from transformers import AutoTokenizer

from testing.ct_oracle import ct_oracle_model
from testing.models import build_ct_model
from testing.shards import ShardProcess
from textgen_server.config import DISABLE_CUSTOM_KERNELS, UnsupportedConfigError
from textgen_server.layers import cpu_ops, quant_kernels
from textgen_server.layers.linear_choice import BUCKET_ROWS, bucket
from textgen_server.layers.quant_kernels import Int4Kernel, Int8DynamicKernel, Int8Kernel
from textgen_server.layers.quantization import read_quant_config
from textgen_server.layers.quantized_weight import QuantConfig, QuantizedWeight

PROMPT = [1, 5, 9, 100, 200, 300, 7, 42]
# bfloat16 activations against the float32 oracle, max |log-softmax difference|: the float model itself in bfloat16
# is 0.13-0.16 apart here; with W8A8 the activations' int8 rounding moves with them (transformers' own bfloat16 run
# of the W8A8 checkpoint is 0.38 from its float32 one).
BF16_LOGPROB_TOLERANCE = {"w4a16": 0.3, "w4a16-asym": 0.3, "w8a16": 0.3, "w8a8": 0.5}
# Which packed kernel computes each scheme's projections, by activation dtype (None: dequantized at load).
KERNELS = {
    "w4a16": {torch.float32: None, torch.bfloat16: Int4Kernel},
    "w4a16-asym": {torch.float32: None, torch.bfloat16: Int4Kernel},
    "w8a16": {torch.float32: None, torch.bfloat16: Int8Kernel},
    "w8a8": {torch.float32: Int8DynamicKernel, torch.bfloat16: Int8DynamicKernel},
}


@pytest.fixture(scope="module", params=sorted(KERNELS))
def scheme(request: pytest.FixtureRequest) -> tuple[str, Path, torch.Tensor]:
    """(the scheme, its checkpoint, the oracle's float32 logits of PROMPT)."""
    model_dir = build_ct_model(request.param)
    with torch.inference_mode():
        logits = ct_oracle_model(model_dir)(torch.tensor([PROMPT])).logits[0].float()
    return request.param, model_dir, logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_each_scheme_computes_what_transformers_computes(
    scheme: tuple[str, Path, torch.Tensor], dtype: torch.dtype
) -> None:
    name, model_dir, want = scheme
    got, linears = quantized_logits(model_dir, dtype, PROMPT, "compressed-tensors")
    kernel = KERNELS[name][dtype]
    projections, head = linears[:-1], linears[-1]
    assert head.packed is None and head.dequantized is None  # `ignore: [lm_head]`: a float weight
    if kernel is None:
        assert all(m.packed is None and m.dequantized for m in projections)
    else:
        assert all(type(m.packed) is kernel for m in projections)
    if dtype == torch.float32:
        # W8A8: the same integers; only the float sums' order differs from the package's fake quantization
        assert torch.allclose(got, want, atol=1e-3 if name == "w8a8" else 1e-4, rtol=0)
    else:
        logprobs = torch.log_softmax(got, -1) - torch.log_softmax(want, -1)
        assert logprobs.abs().max() < BF16_LOGPROB_TOLERANCE[name]


def test_a_checkpoint_that_quantizes_its_lm_head_has_it_served_packed() -> None:
    model_dir = build_ct_model("w4a16", lm_head=True)
    with torch.inference_mode():
        want = ct_oracle_model(model_dir)(torch.tensor([PROMPT])).logits[0].float()
    got, linears = quantized_logits(model_dir, torch.float32, PROMPT, "compressed-tensors")
    assert linears[-1].dequantized and torch.allclose(got, want, atol=1e-4, rtol=0)
    got, linears = quantized_logits(model_dir, torch.bfloat16, PROMPT, "compressed-tensors")
    assert all(type(m.packed) is Int4Kernel for m in linears)  # the head included
    logprobs = torch.log_softmax(got, -1) - torch.log_softmax(want, -1)
    assert logprobs.abs().max() < BF16_LOGPROB_TOLERANCE["w4a16"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_every_w8a8_path_computes_the_integer_product(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The paths timed at load differ in speed only: `float` sums the same integers exactly, `gemv` rounds its sum
    to bfloat16 once before the activations' scale."""
    monkeypatch.delenv(DISABLE_CUSTOM_KERNELS, raising=False)
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "1")
    g = torch.Generator().manual_seed(0)
    weight = QuantizedWeight.per_channel_int8(torch.randn(96, 256, generator=g).to(dtype))
    weight.dynamic_activations = True
    kernel = Int8DynamicKernel(weight, None)
    assert len(kernel.paths) == len(BUCKET_ROWS) and set(kernel.paths) <= set(kernel.PATHS)
    assert "gemv" not in kernel.paths[1:] and (kernel.gemv or "gemv" not in kernel.paths)
    assert kernel.gemv == (dtype == torch.bfloat16 and cpu_ops.kernel_available())
    for rows in (1, 3, 40):
        x = torch.randn(rows, 256, generator=g).to(dtype)
        ints, scale = kernel._quantize(x)
        want = kernel._product("int_mm", ints, scale, dtype)
        assert torch.equal(kernel._product("float", ints, scale, dtype), want)
        if kernel.gemv and rows == 1:
            got = kernel._product("gemv", ints, scale, dtype)
            assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=1e-2 * float(want.abs().max()))
        assert torch.equal(kernel(x), kernel._product(kernel.paths[bucket(rows)], ints, scale, dtype))


def test_with_custom_kernels_off_w8a8_times_nothing_and_multiplies_with_int_mm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_CUSTOM_KERNELS, "True")
    monkeypatch.setattr(quant_kernels, "least_seconds", lambda *args: pytest.fail("timed at load"))
    weight = QuantizedWeight.per_channel_int8(
        torch.randn(96, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    )
    weight.dynamic_activations = True
    kernel = Int8DynamicKernel(weight, None)
    assert kernel.paths == ("int_mm",) * len(BUCKET_ROWS) and not kernel.gemv


def _ct_config(fmt: str = "pack-quantized", **group: object) -> dict[str, object]:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    base: dict[str, object] = {"targets": ["Linear"], "weights": weights, "input_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": {**base, **group}},
        "ignore": ["lm_head"],
    }


@pytest.mark.parametrize(
    "quantization, message",
    [
        (_ct_config("float-quantized"), "format float-quantized"),
        (_ct_config("nvfp4-pack-quantized"), "format nvfp4-pack-quantized"),
        (_ct_config(targets=["re:.*q_proj"]), r"targets \['re:.\*q_proj'\]"),
        (_ct_config(weights={"num_bits": 8, "type": "float", "strategy": "channel"}), "float 8-bit weights"),
        (_ct_config(weights={"num_bits": 4, "type": "int", "strategy": "tensor"}), "int 4-bit weights by tensor"),
        (
            _ct_config(input_activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
            "quantized input activations in pack-quantized format",
        ),
        (
            _ct_config(
                "int-quantized",
                weights={"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                input_activations={"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False},
            ),
            "int-quantized weights of 8 bits with input activations",
        ),
    ],
)
def test_schemes_textgen_does_not_serve_are_refused_naming_them(
    quantization: dict[str, object], message: str, tmp_path: Path
) -> None:
    config = {"model_type": "llama", "quantization_config": quantization}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedConfigError, match=f"compressed-tensors checkpoint with {message}"):
        read_quant_config(tmp_path, config, None)


def test_ignore_names_modules_exactly_or_by_pattern() -> None:
    quant = QuantConfig("compressed-tensors", 4, 32, modules_to_not_convert=("lm_head", "re:.*mlp\\.down_proj"))
    assert not quant.quantizes("lm_head") and not quant.quantizes("model.layers.3.mlp.down_proj")
    assert quant.quantizes("model.layers.3.mlp.up_proj") and quant.quantizes("model.layers.3.self_attn.o_proj")
    assert quant.quantizes("lm_head_extra")  # an exact name, not a part of one


def test_one_and_two_shards_generate_what_transformers_generates() -> None:
    model_dir = build_ct_model("w4a16")
    oracle, tokenizer = ct_oracle_model(model_dir), AutoTokenizer.from_pretrained(model_dir)
    prompts = ["def fill(self, text):", "The quick brown"]
    want = {}
    for i, text in enumerate(prompts):
        ids = tokenizer(text, return_tensors="pt")
        with torch.inference_mode():
            out = oracle.generate(**ids, max_new_tokens=8, do_sample=False)
        want[i] = out[0, ids.input_ids.shape[1] :].tolist()
    requests = [make_request(i, text, 8, ignore_eos=False) for i, text in enumerate(prompts)]
    for ranks in (1, 2):  # the checkpoint's config says compressed-tensors: no flag
        with ShardProcess(model_dir, num_shard=ranks, extra_args=["--dtype", "float32"]) as handle:
            assert generate_on_ranks(handle, requests)[0] == want, f"{ranks} shard(s)"
