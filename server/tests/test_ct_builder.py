"""The offline compressed-tensors checkpoint builder (textgen_server.ct_builder) and its oracle (testing.ct_oracle).

The compressed-tensors package writes these checkpoints, so what is checked here is that they hold what llmcompressor
publishes for each scheme: the quantization_config fields, the tensor names, dtypes and shapes, and the packing, read
back by a few lines of unpacking written here (and one int32 word of the package's packer worked out by hand), so the
layout the module docstring states is pinned. Every weight the package decompresses lies within half a step of its
float value, and transformers runs each checkpoint (W8A8 with its per-token activation quantization).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from testing.ct_oracle import ct_dequantized_weights, ct_oracle_logits
from testing.models import build_ct_model
from textgen_server import ct_builder

G = ct_builder.GROUP_SIZE
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUT_IDS = [0, 5, 17, 300, 42, 7, 911, 64]

# Per scheme: weight bits, symmetric, strategy, format, and whether the input activations are quantized.
SCHEMES = {
    "w4a16": (4, True, "group", "pack-quantized", False),
    "w4a16-asym": (4, False, "group", "pack-quantized", False),
    "w8a16": (8, True, "channel", "pack-quantized", False),
    "w8a8": (8, True, "channel", "int-quantized", True),
}


def int32(word: int) -> int:
    """The signed int32 that has the bits of the unsigned 32-bit `word` (how safetensors holds a packed word)."""
    return word - 2**32 if word >= 2**31 else word


def unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed levels [R, C * 32/bits] of int32 `words` [R, C]: field f of word c is element c * 32/bits + f, read
    from bit bits * f up, stored with an offset of 2^(bits-1)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = torch.bitwise_right_shift(words.unsqueeze(-1), shifts) & (2**bits - 1)
    return fields.reshape(words.shape[0], -1).to(torch.int64) - 2 ** (bits - 1)


def projections(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The decoder projections' module names, from the float checkpoint's weight names."""
    return sorted(
        name.removesuffix(".weight")
        for name in tensors
        if name.startswith("model.layers.") and name.removesuffix(".weight").rsplit(".", 1)[-1] in PROJECTIONS
    )


@pytest.fixture(scope="module", params=list(SCHEMES))
def built(request: pytest.FixtureRequest, tiny_llama: Path) -> tuple[str, Path]:
    return request.param, build_ct_model(request.param)


def test_package_packs_by_hand() -> None:
    """The package's packer, on values worked out by hand: 8 nibbles per int32 along the last dimension (zero points:
    along dim 0), the first value in the lowest bits, each stored as q + 8; 8-bit values 4 per word, q + 128."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.tensor([[-8, -7, -6, -5, -4, -3, -2, 7]], dtype=torch.int8)  # stored 0..6, 15
    assert pack_to_int32(q, 4).tolist() == [[int32(0xF6543210)]]
    assert pack_to_int32(q.t().contiguous(), 4, packed_dim=0).tolist() == [[int32(0xF6543210)]]
    q8 = torch.tensor([[-128, -1, 0, 127]], dtype=torch.int8)  # stored 0x00, 0x7F, 0x80, 0xFF
    assert pack_to_int32(q8, 8).tolist() == [[int32(0xFF807F00)]]
    assert unpack(pack_to_int32(q, 4), 4).tolist() == q.tolist()


def test_quantization_config(built: tuple[str, Path], tiny_llama: Path) -> None:
    import compressed_tensors

    scheme, model_dir = built
    bits, symmetric, strategy, fmt, activations = SCHEMES[scheme]
    config = json.loads((model_dir / "config.json").read_text())
    qconfig = config.pop("quantization_config")
    assert config == json.loads((tiny_llama / "config.json").read_text())
    assert qconfig["quant_method"] == "compressed-tensors"
    assert qconfig["format"] == fmt
    assert qconfig["quantization_status"] == "compressed"
    assert qconfig["ignore"] == ["lm_head"]
    assert qconfig["kv_cache_scheme"] is None
    assert qconfig["version"] == compressed_tensors.__version__
    assert list(qconfig["config_groups"]) == ["group_0"]
    group = qconfig["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["format"] == fmt
    assert group["weights"] == {
        "num_bits": bits,
        "type": "int",
        "symmetric": symmetric,
        "strategy": strategy,
        "group_size": G if strategy == "group" else None,
        "dynamic": False,
    }
    if activations:
        assert group["input_activations"] == {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "strategy": "token",
            "group_size": None,
            "dynamic": True,
        }
    else:
        assert group["input_activations"] is None
    assert group["output_activations"] is None


def test_tensor_names_dtypes_and_shapes(built: tuple[str, Path], tiny_llama: Path) -> None:
    scheme, model_dir = built
    bits, symmetric, strategy, fmt, _ = SCHEMES[scheme]
    source = load_file(tiny_llama / "model.safetensors")
    tensors = load_file(model_dir / "model.safetensors")
    expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for prefix in projections(source):
        n, k = source[f"{prefix}.weight"].shape
        scales = k // G if strategy == "group" else 1
        expected[f"{prefix}.weight_scale"] = (torch.float32, (n, scales))
        if fmt == "int-quantized":
            expected[f"{prefix}.weight"] = (torch.int8, (n, k))
            continue
        expected[f"{prefix}.weight_packed"] = (torch.int32, (n, k * bits // 32))
        expected[f"{prefix}.weight_shape"] = (torch.int64, (2,))
        assert tensors[f"{prefix}.weight_shape"].tolist() == [n, k]
        if not symmetric:
            expected[f"{prefix}.weight_zero_point"] = (torch.int32, (n * bits // 32, scales))
    quantized = set(f"{prefix}.weight" for prefix in projections(source))
    for name, tensor in source.items():
        if name not in quantized:  # embeddings, norms, lm_head: as in the source
            expected[name] = (tensor.dtype, tuple(tensor.shape))
            assert torch.equal(tensors[name], tensor), name
    assert {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()} == expected
    for file_name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (model_dir / file_name).read_bytes() == (tiny_llama / file_name).read_bytes()


def test_levels_are_round_to_nearest_of_the_float_weights(built: tuple[str, Path], tiny_llama: Path) -> None:
    """Unpacked here: each level is round(w / s + z) clamped to the signed range, s is the group's (or row's) range
    over the levels (zero always inside), and (q - z) * s is what the package decompresses, within half a step."""
    scheme, model_dir = built
    bits, symmetric, strategy, fmt, _ = SCHEMES[scheme]
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    source = load_file(tiny_llama / "model.safetensors")
    tensors = load_file(model_dir / "model.safetensors")
    decompressed = ct_dequantized_weights(model_dir)
    for prefix in projections(source):
        w = source[f"{prefix}.weight"]
        n, k = w.shape
        scale = tensors[f"{prefix}.weight_scale"]
        if fmt == "int-quantized":
            q = tensors[f"{prefix}.weight"].to(torch.int64)
        else:
            q = unpack(tensors[f"{prefix}.weight_packed"], bits)
        assert q.shape == (n, k) and int(q.min()) >= qmin and int(q.max()) <= qmax
        groups = w.unflatten(-1, (k // G, G)) if strategy == "group" else w.unsqueeze(1)
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        if symmetric:
            zero = torch.zeros_like(scale, dtype=torch.int64)
            torch.testing.assert_close(scale, torch.maximum(-low, high) / ((qmax - qmin) / 2), rtol=1e-6, atol=0)
        else:
            zero = unpack(tensors[f"{prefix}.weight_zero_point"].t().contiguous(), bits).t()[:n]
            torch.testing.assert_close(scale, (high - low) / (qmax - qmin), rtol=1e-6, atol=0)
            assert torch.equal(zero, torch.round(qmin - low / scale).clamp(qmin, qmax).to(torch.int64))
        step = scale.repeat_interleave(G, dim=1) if strategy == "group" else scale.expand(n, k)
        z = zero.repeat_interleave(G, dim=1) if strategy == "group" else zero.expand(n, k)
        assert torch.equal(q, torch.round(w / step + z).clamp(qmin, qmax).to(torch.int64)), prefix
        mine = (q - z).to(torch.float32) * step
        assert torch.equal(decompressed[f"{prefix}.weight"], mine), prefix
        error = (mine - w).abs()
        # Half a step, give or take float32 rounding: a group's extreme sits at +-(2^(bits-1) - 1/2) steps.
        assert bool((error <= 0.5 * step + 1e-6 * w.abs()).all()), f"{prefix}: {float((error / step).max())} steps"
        assert float(error.max()) > 0  # quantized, not copied


def test_decompressed_checkpoint_is_complete(built: tuple[str, Path], tiny_llama: Path) -> None:
    source = load_file(tiny_llama / "model.safetensors")
    decompressed = ct_dequantized_weights(built[1])
    assert {name: (t.dtype, t.shape) for name, t in decompressed.items()} == {
        name: (t.dtype, t.shape) for name, t in source.items()
    }


def test_oracle_runs_the_checkpoint(built: tuple[str, Path], tiny_llama: Path) -> None:
    """transformers' logits on the checkpoint equal a float model's on the package's decompressed weights, except for
    W8A8, whose per-token activation quantization moves them a little."""
    scheme, model_dir = built
    activations = SCHEMES[scheme][4]
    logits = ct_oracle_logits(model_dir, INPUT_IDS)
    config = AutoConfig.from_pretrained(tiny_llama)
    assert logits.dtype == torch.float32 and logits.shape == (len(INPUT_IDS), config.vocab_size)
    assert bool(torch.isfinite(logits).all())
    greedy = logits.argmax(-1).tolist()
    assert all(0 <= token < config.vocab_size for token in greedy)

    dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense.load_state_dict(ct_dequantized_weights(model_dir), strict=True)
    dense.eval()
    with torch.no_grad():
        weight_only = dense(torch.tensor([INPUT_IDS])).logits[0]
    difference = float((logits - weight_only).abs().max())
    if activations:
        assert 1e-4 < difference < 1.0, difference
    else:
        assert difference < 1e-4, difference


def test_build_is_deterministic_and_reused(tmp_path: Path, tiny_llama: Path) -> None:
    out = ct_builder.build_compressed_tensors_model(tiny_llama, tmp_path / "w4a16", "w4a16")
    assert (out / "model.safetensors").read_bytes() == (build_ct_model("w4a16") / "model.safetensors").read_bytes()
    written = (out / "model.safetensors").stat().st_mtime_ns
    assert ct_builder.build_compressed_tensors_model(tiny_llama, out, "w4a16") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w4a16"]
    with pytest.raises(ValueError, match="unknown compressed-tensors scheme"):
        ct_builder.build_compressed_tensors_model(tiny_llama, tmp_path / "x", "w3a16")
