"""The offline GPTQ/AWQ checkpoint builder against the separately written dequantizing oracle (testing.dequantize).

Known matrices packed by the builder and unpacked by the oracle come back exactly, and one int32 of each layout is
checked against a value worked out by hand from the published layout, so a misunderstanding shared by the packer
and the oracle cannot pass. On the tiny llama: every dequantized weight lies within half a step of its float
value, and transformers loads and generates from the oracle's float checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from testing import dequantize
from testing.models import build_dequantized_oracle, build_quantized_model, edited_copy
from textgen_server import quant_builder

N, K, G = 16, 64, 32
GROUPS = K // G
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def int32(word: int) -> int:
    """The signed int32 that has the bits of the unsigned 32-bit `word` (how safetensors holds a packed word)."""
    return word - 2**32 if word >= 2**31 else word


class Known(NamedTuple):
    """A hand-made quantized matrix: q [N, K], real zeros and scales [N, GROUPS], g_idx [K], and w [N, K]."""

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor
    expected: torch.Tensor


def known_matrix(bits: int, sym: bool, g_idx: torch.Tensor | None = None) -> Known:
    """Integer levels from a fixed formula, with the first few entries set by hand for the word checks below.

    Scales are powers of two times 1 or 1.5, exact in float16, so the expected float matrix is exact too.
    """
    maxq = 2**bits - 1
    n = torch.arange(N).unsqueeze(1)
    k = torch.arange(K).unsqueeze(0)
    q = (3 * n + 5 * k + 7) % (maxq + 1)
    g = torch.arange(GROUPS).unsqueeze(0)
    if sym:
        zeros = torch.full((N, GROUPS), 2 ** (bits - 1))
    else:
        zeros = 1 + (n + 5 * g) % maxq  # in [1, maxq]: GPTQ v1 stores zero - 1, which must not be negative
    scales = (2.0 ** -(n % 4 + 2)) * (1 + 0.5 * g)
    if g_idx is None:
        g_idx = torch.arange(K) // G
    expected = (q - zeros[:, g_idx]).float() * scales[:, g_idx]
    return Known(q, zeros, scales, g_idx, expected)


def act_order_g_idx(seed: int = 3) -> torch.Tensor:
    """g_idx of an act-order checkpoint: a random permutation's first G columns are group 0, and so on."""
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(K, dtype=torch.int64)
    g_idx[perm] = torch.arange(K) // G
    return g_idx


@pytest.mark.parametrize(
    ("bits", "sym", "act_order"),
    [(4, True, False), (8, True, False), (4, True, True), (4, False, False), (8, False, True)],
    ids=["gptq4", "gptq8", "gptq4-act", "gptq4-asym", "gptq8-asym-act"],
)
def test_gptq_known_matrix_round_trips_exactly(bits: int, sym: bool, act_order: bool) -> None:
    known = known_matrix(bits, sym, act_order_g_idx() if act_order else None)
    packed = quant_builder.pack_gptq(known.q, known.zeros, known.scales.to(torch.float16), known.g_idx, bits)
    per_word = 32 // bits
    assert packed["qweight"].dtype == packed["qzeros"].dtype == packed["g_idx"].dtype == torch.int32
    assert packed["qweight"].shape == (K // per_word, N)
    assert packed["qzeros"].shape == (GROUPS, N // per_word)
    assert packed["scales"].dtype == torch.float16 and packed["scales"].shape == (GROUPS, N)
    assert packed["g_idx"].tolist() == known.g_idx.tolist()
    w = dequantize.unpack_gptq(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], bits)
    assert w.dtype == torch.float32
    assert torch.equal(w, known.expected)


def test_gptq_words_match_the_layout_by_hand() -> None:
    """Row 0 of qweight packs k = 0..P-1 of each output column, k = j at bit offset bits * j."""
    known = known_matrix(4, sym=False)
    known.q[0, :8] = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])  # column n = 0, inputs k = 0..7
    known.zeros[:8, 0] = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])  # group 0, outputs n = 0..7: stored 0..7
    packed = quant_builder.pack_gptq(known.q, known.zeros, known.scales, known.g_idx, 4)
    assert packed["qweight"][0, 0].item() == int32(0x87654321)
    assert packed["qzeros"][0, 0].item() == 0x76543210

    known8 = known_matrix(8, sym=True)
    known8.q[0, :4] = torch.tensor([0x11, 0x22, 0x33, 0xF4])
    packed8 = quant_builder.pack_gptq(known8.q, known8.zeros, known8.scales, known8.g_idx, 8)
    assert packed8["qweight"][0, 0].item() == int32(0xF4332211)
    assert packed8["qzeros"][0, 0].item() == 0x7F7F7F7F  # symmetric zero 128, stored as 127
    sym4 = quant_builder.pack_gptq(*known_matrix(4, sym=True)[:4], 4)
    assert sym4["qzeros"][0, 0].item() == 0x77777777  # symmetric zero 8, stored as 7


def test_awq_known_matrix_round_trips_exactly() -> None:
    known = known_matrix(4, sym=False)
    packed = quant_builder.pack_awq(known.q, known.zeros, known.scales.to(torch.float16))
    assert set(packed) == {"qweight", "qzeros", "scales"}
    assert packed["qweight"].dtype == packed["qzeros"].dtype == torch.int32
    assert packed["qweight"].shape == (K, N // 8)
    assert packed["qzeros"].shape == (GROUPS, N // 8)
    assert packed["scales"].dtype == torch.float16 and packed["scales"].shape == (GROUPS, N)
    w = dequantize.unpack_awq(packed["qweight"], packed["qzeros"], packed["scales"], G)
    assert torch.equal(w, known.expected)


def test_awq_words_match_the_interleaved_layout_by_hand() -> None:
    """Nibble slot j holds output column ORDER[j], ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; the zero is stored as is."""
    known = known_matrix(4, sym=False)
    known.q[:8, 0] = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])  # input k = 0, outputs n = 0..7
    # Slots 0..7 hold columns 0, 2, 4, 6, 1, 3, 5, 7: values 1, 3, 5, 7, 2, 4, 6, 8; slot 7 is the top nibble.
    known.zeros[:8, 0] = torch.tensor([9, 10, 11, 12, 13, 14, 15, 1])
    # Zeros by slot: 9, 11, 13, 15, 10, 12, 14, 1.
    packed = quant_builder.pack_awq(known.q, known.zeros, known.scales)
    assert packed["qweight"][0, 0].item() == int32(0x86427531)
    assert packed["qzeros"][0, 0].item() == 0x1ECAFDB9


def test_pack_rejects_out_of_range_levels() -> None:
    known = known_matrix(4, sym=True)
    known.q[0, 0] = 16
    with pytest.raises(ValueError):
        quant_builder.pack_gptq(known.q, known.zeros, known.scales, known.g_idx, 4)
    with pytest.raises(ValueError):
        quant_builder.pack_awq(known.q, known.zeros, known.scales)


class Variant(NamedTuple):
    method: str
    bits: int
    desc_act: bool
    sym: bool
    lm_head: bool = False

    def quantizes(self, prefix: str) -> bool:
        """Whether the checkpoint stores the module at `prefix` quantized."""
        return prefix.rsplit(".", 1)[-1] in PROJECTIONS or (self.lm_head and prefix == "lm_head")


VARIANTS = {
    "gptq4": Variant("gptq", 4, False, True),
    "gptq8": Variant("gptq", 8, False, True),
    "gptq4-act": Variant("gptq", 4, True, True),
    "gptq4-asym": Variant("gptq", 4, False, False),
    "awq": Variant("awq", 4, False, True),
    "gptq4-head": Variant("gptq", 4, False, True, lm_head=True),
}


class Built(NamedTuple):
    variant: Variant
    quantized: Path
    oracle: Path


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def built(request: pytest.FixtureRequest, tiny_llama: Path) -> Built:
    variant = VARIANTS[request.param]
    quantized = build_quantized_model(*variant)
    return Built(variant, quantized, build_dequantized_oracle(quantized))


def test_checkpoint_has_the_published_tensors_and_config(built: Built, tiny_llama: Path) -> None:
    method, bits, desc_act, sym, lm_head = built.variant
    per_word = 32 // bits
    source = load_file(tiny_llama / "model.safetensors")
    tensors = load_file(built.quantized / "model.safetensors")
    config = json.loads((built.quantized / "config.json").read_text())
    source_config = json.loads((tiny_llama / "config.json").read_text())
    qconfig = config.pop("quantization_config")
    assert config == source_config  # the dtype entry included: the source's, not float16
    if method == "gptq":
        assert qconfig == {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": G,
            "desc_act": desc_act,
            "sym": sym,
            "checkpoint_format": "gptq",
            "true_sequential": True,
            "damp_percent": 0.01,
            "static_groups": False,
            "lm_head": lm_head,
        }
    else:
        assert qconfig == {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True, "version": "gemm"}
    for name, tensor in source.items():
        prefix = name.removesuffix(".weight")
        if not built.variant.quantizes(prefix):
            assert torch.equal(tensors[name], tensor) and tensors[name].dtype == tensor.dtype, name
            continue
        assert name not in tensors
        n, k = tensor.shape
        expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
            "qweight": (torch.int32, (k // per_word, n) if method == "gptq" else (k, n // per_word)),
            "qzeros": (torch.int32, (k // G, n // per_word)),
            "scales": (torch.float16, (k // G, n)),
        }
        if method == "gptq":
            expected["g_idx"] = (torch.int32, (k,))
        found = {
            s: (t.dtype, tuple(t.shape))
            for s in ("qweight", "qzeros", "scales", "g_idx")
            if (t := tensors.get(f"{prefix}.{s}")) is not None
        }
        assert found == expected, prefix
        if method == "gptq":
            g_idx = tensors[f"{prefix}.g_idx"]
            assert torch.bincount(g_idx).tolist() == [G] * (k // G)  # every group G columns
            # Without act order the groups are contiguous runs; with it, some column is out of its run.
            assert torch.equal(g_idx, torch.arange(k, dtype=torch.int32) // G) != desc_act


def test_dequantized_weights_within_half_a_step(built: Built, tiny_llama: Path) -> None:
    method, bits = built.variant.method, built.variant.bits
    source = load_file(tiny_llama / "model.safetensors")
    tensors = load_file(built.quantized / "model.safetensors")
    oracle = load_file(built.oracle / "model.safetensors")
    assert set(oracle) == set(source)
    total_err = total_norm = 0.0
    for name, w_float in source.items():
        w = oracle[name]
        assert w.dtype == torch.float32
        prefix = name.removesuffix(".weight")
        if not built.variant.quantizes(prefix):
            assert torch.equal(w, w_float.float()), name
            continue
        scales = tensors[f"{prefix}.scales"].float()
        k = w.shape[1]
        groups = tensors[f"{prefix}.g_idx"].long() if method == "gptq" else torch.arange(k) // G
        step = scales[groups].t()  # [N, K]: the step each weight was quantized with
        err = (w - w_float).abs()
        # Round to nearest: half a step, with room for float32 rounding of w / step.
        assert bool((err <= 0.5 * step * (1 + 1e-4) + 1e-7).all()), name
        # And the steps are tight: a step never exceeds the group's range spread over the levels (zero included).
        amax = w_float.abs().amax()
        assert float(step.max()) <= 2 * float(amax) / (2**bits - 2) * 1.01, name
        total_err += float((err**2).sum())
        total_norm += float((w_float**2).sum())
    relative = (total_err / total_norm) ** 0.5
    # RTN on Gaussian weights, groups of 32: about 0.095 (4-bit symmetric), 0.081 (asymmetric), 0.0056 (8-bit).
    assert relative < (0.12 if bits == 4 else 0.01)


def test_oracle_loads_and_generates_in_transformers(built: Built, tiny_llama: Path) -> None:
    config = json.loads((built.oracle / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert (built.oracle / "tokenizer.json").is_file() and (built.oracle / "tokenizer_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(built.oracle)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama)
    ids = torch.tensor([[0, 5, 100, 200, 300, 400, 17, 33]])
    with torch.no_grad():
        logits, float_logits = model(ids).logits, reference(ids).logits
    # The random tiny model is wide (std 0.2), so 4 bits move its logits a fair way; 8 bits hardly at all.
    similarity = torch.nn.functional.cosine_similarity(logits.flatten(), float_logits.flatten(), dim=0).item()
    assert similarity > (0.9 if built.variant.bits == 4 else 0.99)
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)


def test_builds_are_cached_by_stamp(tiny_llama: Path, tmp_path: Path) -> None:
    out = quant_builder.quantize_model_dir(tiny_llama, tmp_path / "q", "gptq", bits=8)
    mtime = os.stat(out / "model.safetensors").st_mtime_ns
    assert quant_builder.quantize_model_dir(tiny_llama, out, "gptq", bits=8) == out
    assert os.stat(out / "model.safetensors").st_mtime_ns == mtime
    # Other arguments rebuild in place.
    quant_builder.quantize_model_dir(tiny_llama, out, "gptq", bits=4)
    assert load_file(out / "model.safetensors")["model.layers.0.self_attn.q_proj.qweight"].shape == (64 // 8, 64)
    assert not list(tmp_path.glob("*.building-*"))
    oracle = dequantize.dequantize_model_dir(out, tmp_path / "f")
    mtime = os.stat(oracle / "model.safetensors").st_mtime_ns
    assert dequantize.dequantize_model_dir(out, tmp_path / "f") == oracle
    assert os.stat(oracle / "model.safetensors").st_mtime_ns == mtime


@pytest.mark.parametrize(
    ("method", "bits", "desc_act", "sym", "lm_head"),
    [
        ("gptq", 3, False, True, False),
        ("awq", 8, False, True, False),
        ("awq", 4, True, True, False),
        ("awq", 4, False, False, False),
        ("awq", 4, False, True, True),
        ("x", 4, False, True, False),
    ],
)
def test_unsupported_arguments_raise(
    tiny_llama: Path, tmp_path: Path, method: str, bits: int, desc_act: bool, sym: bool, lm_head: bool
) -> None:
    with pytest.raises(ValueError):
        quant_builder.quantize_model_dir(
            tiny_llama, tmp_path / "q", method, bits=bits, desc_act=desc_act, sym=sym, lm_head=lm_head
        )
    assert not (tmp_path / "q").exists()


def test_a_tied_lm_head_is_not_quantized_on_its_own(tiny_llama: Path, tmp_path: Path) -> None:
    tied = edited_copy(tiny_llama, tmp_path / "tied", "config.json", lambda c: c.update(tie_word_embeddings=True))
    tensors = load_file(tied / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, str(tied / "model.safetensors"))
    with pytest.raises(ValueError, match="ties its LM head"):
        quant_builder.quantize_model_dir(tied, tmp_path / "q", "gptq", lm_head=True)
    assert not (tmp_path / "q").exists()
