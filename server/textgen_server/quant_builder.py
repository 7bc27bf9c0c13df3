"""Builds GPTQ (v1, AutoGPTQ layout) and AWQ (AutoAWQ GEMM layout) checkpoints offline from a float model.

No hub is reachable here, so the quantized kernels are tested on checkpoints made from the project's tiny random
float models (`textgen_server.builder`). Quantization is plain round-to-nearest per group, not the Hessian-guided
GPTQ or activation-aware AWQ search: what matters for a loader is the published tensor layout, and RTN is enough
to keep the quantized model close to its float source (every weight within half a step of its float value).

Contract: ``quantize_model_dir(src, out, method, bits, group_size, desc_act, sym, seed, lm_head) -> Path``
writes ``out`` (config.json with ``quantization_config``, model.safetensors, the tokenizer and generation config
of ``src``) through a temporary directory plus rename, and returns at once when ``out`` already holds the same build
(``quant-stamp.json`` says which). Deterministic for given arguments, source model and torch version.

Layouts written, for every decoder projection ``p`` with float weight [N (out), K (in)], group size G:

- gptq: ``p.qweight`` int32 [K / (32/bits), N], ``32/bits`` values of k packed in one word (value of
  k = i * (32/bits) + j at bit offset bits * j of row i); ``p.qzeros`` int32 [K/G, N / (32/bits)] packed along N
  the same way, holding zero - 1 (GPTQ v1); ``p.scales`` float16 [K/G, N]; ``p.g_idx`` int32 [K].
  w[n, k] = (q[k, n] - (stored_zero[g_idx[k], n] + 1)) * scales[g_idx[k], n].
- awq (4-bit): ``p.qweight`` int32 [K, N/8] packed along N in AWQ's interleaved order (nibble j of a word holds
  output column 8 * word + AWQ_ORDER[j]); ``p.qzeros`` int32 [K/G, N/8] the same way, holding the zero itself;
  ``p.scales`` float16 [K/G, N]; no g_idx. w[n, k] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n].
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from textgen_server import builder
from textgen_server.builder import is_built, publish

# Bumped whenever the bytes written for the same arguments change, so cached builds are not reused.
QUANT_BUILDER_VERSION = 3

STAMP = "quant-stamp.json"
METHODS = ("gptq", "awq")

# The decoder projections a Llama-family model has; GPTQ and AWQ quantize exactly these and nothing else.
PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)

# AutoAWQ GEMM packing: nibble slot j of an int32 holds output column AWQ_ORDER[j] of its group of 8 columns.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

# Files copied from the source as they are: the tokenizer in any of its usual forms, and the generation config.
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)


def quantize_model_dir(
    src: str | Path,
    out: str | Path,
    method: str,
    bits: int = 4,
    group_size: int = 32,
    desc_act: bool = False,
    sym: bool = True,
    seed: int = 0,
    lm_head: bool = False,
) -> Path:
    """Quantize every decoder projection of the float Llama-family model `src` into `out`; returns `out`.

    method: "gptq" (bits 4 or 8; `desc_act` gives a seeded random act-order permutation standing in for the
    Hessian order; `sym` False gives per-group min/max zeros) or "awq" (4-bit, always asymmetric, so `sym` and
    `desc_act` must keep their defaults). group_size -1 means one group over the whole input dimension.
    Embeddings, norms, lm_head and biases keep the source dtype; `lm_head` (gptq only, GPTQModel's option of that
    name) quantizes the untied LM head too, like a projection. Raises ValueError on unsupported arguments or
    shapes that the layout cannot pack.
    """
    _check_arguments(method, bits, desc_act, sym, lm_head)
    src, out = Path(src), Path(out)
    stamp: dict[str, Any] = {
        "quant_builder_version": QUANT_BUILDER_VERSION,
        "source": src.name,
        "source_stamp": _read_source_stamp(src),
        "method": method,
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "seed": seed,
        "lm_head": lm_head,
    }
    if is_built(out, stamp, STAMP):
        return out

    weights = _load_weights(src)
    if lm_head and "lm_head.weight" not in weights:
        raise ValueError(f"{src} ties its LM head to the embeddings: there is no LM head of its own to quantize")
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    act_orders: dict[str, torch.Tensor] = {}
    # Sorted, so that the permutations drawn from the one generator do not depend on the file's tensor order.
    for name in sorted(weights):
        tensor = weights[name]
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and _quantized(prefix, lm_head)):
            tensors[name] = tensor  # embeddings, norms, lm_head, biases: untouched, in the source dtype
            continue
        w = tensor.to(torch.float32)
        n, k = w.shape
        g = k if group_size == -1 else group_size
        _check_shape(name, method, bits, n, k, g)
        if method == "gptq":
            if desc_act:
                # One order per input: GPTQ ranks a layer's input features by its Hessian, the same for the
                # projections that read one input (q/k/v, gate/up), so they share their g_idx.
                shared = _input_key(prefix)
                if shared not in act_orders:
                    act_orders[shared] = torch.randperm(k, generator=generator)
                perm = act_orders[shared]
                g_idx = torch.empty(k, dtype=torch.int64)
                # Column perm[i] is the i-th in act order; groups are consecutive runs of that order.
                g_idx[perm] = torch.arange(k) // g
            else:
                g_idx = torch.arange(k) // g
            q, zeros, scales = quantize_rtn(w, bits, g_idx, sym=sym, zero_min=1 if not sym else 0)
            packed = pack_gptq(q, zeros, scales, g_idx, bits)
        else:
            g_idx = torch.arange(k) // g
            q, zeros, scales = quantize_rtn(w, bits, g_idx, sym=False)
            packed = pack_awq(q, zeros, scales)
        for suffix, value in packed.items():
            tensors[f"{prefix}.{suffix}"] = value

    tmp = out.with_name(f"{out.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for file_name in COPIED_FILES:
        if (src / file_name).is_file():
            shutil.copy2(src / file_name, tmp / file_name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, bits, group_size, desc_act, sym, lm_head)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if method == "gptq":
        # AutoGPTQ also writes the settings beside the weights; loaders that predate quantization_config read it.
        quantize_config = dict(config["quantization_config"], model_name_or_path=None, model_file_base_name="model")
        (tmp / "quantize_config.json").write_text(json.dumps(quantize_config, indent=2) + "\n")
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(tmp / "model.safetensors"), {"format": "pt"})
    return publish(tmp, out, stamp, STAMP)


def quantization_config(
    method: str, bits: int, group_size: int, desc_act: bool, sym: bool, lm_head: bool = False
) -> dict[str, Any]:
    """The `quantization_config` entry of config.json as AutoGPTQ/optimum (GPTQModel adds `lm_head`) or AutoAWQ
    write it."""
    if method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "desc_act": desc_act,
            "sym": sym,
            "checkpoint_format": "gptq",
            "true_sequential": True,
            "damp_percent": 0.01,
            "static_groups": False,
            "lm_head": lm_head,
        }
    return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True, "version": "gemm"}


def quantize_rtn(
    w: torch.Tensor, bits: int, g_idx: torch.Tensor, sym: bool, zero_min: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest quantization of `w` [N, K] in the groups `g_idx` [K] names.

    Returns (q [N, K] int64 in [0, 2^bits - 1], zeros [N, groups] int64, scales [N, groups] float16) with
    w ~= (q - zeros[:, g_idx]) * scales[:, g_idx], every weight within half a step of its value. `zero_min` 1 keeps
    asymmetric zeros off 0: GPTQ v1 stores zero - 1, and -1 does not fit in an unsigned field.
    """
    maxq = 2**bits - 1
    groups = int(g_idx.max().item()) + 1
    n = w.shape[0]
    gmin = torch.zeros(n, groups)
    gmax = torch.zeros(n, groups)
    # Zero is always representable (as in AutoGPTQ): the range of each group is widened to include it.
    gmin.scatter_reduce_(1, g_idx.expand(n, -1), w, reduce="amin", include_self=True)
    gmax.scatter_reduce_(1, g_idx.expand(n, -1), w, reduce="amax", include_self=True)
    if sym:
        amax = torch.maximum(-gmin, gmax)
        scales = 2 * amax / maxq
        zeros = torch.full((n, groups), 2 ** (bits - 1), dtype=torch.int64)
    else:
        scales = (gmax - gmin) / maxq
        # A group whose minimum rounds to a zero below zero_min gets the scale that puts its maximum on the top
        # level instead: [-(zero_min) * s, (maxq - zero_min) * s] still covers [min, max].
        low = torch.round(-gmin / _nonzero(scales)) < zero_min
        if zero_min > 0:
            scales = torch.where(low, gmax / (maxq - zero_min), scales)
    # Scales are stored in float16: round up to the next float16 so the stored step still spans the range, and
    # quantize with the stored value so "within half a step" holds for what a loader reads back.
    scales16 = _round_up_half(_nonzero(scales))
    if not sym:
        zeros = torch.round(-gmin / scales16.float()).clamp(zero_min, maxq).to(torch.int64)
    step = scales16.float()[:, g_idx]
    q = torch.round(w / step + zeros[:, g_idx]).clamp(0, maxq).to(torch.int64)
    return q, zeros, scales16


def pack_gptq(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int
) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors from q [N, K] ints, the real zeros [N, groups], scales [N, groups] and g_idx [K].

    Returns {"qweight": int32 [K / (32/bits), N], "qzeros": int32 [groups, N / (32/bits)] (zero - 1 stored),
    "scales": float16 [groups, N], "g_idx": int32 [K]}.
    """
    return {
        "qweight": _pack_rows(q.t(), bits),
        "qzeros": _pack_rows((zeros - 1).t(), bits, along_columns=True),
        "scales": scales.t().to(torch.float16),
        "g_idx": g_idx.to(torch.int32),
    }


def pack_awq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM tensors from 4-bit q [N, K], the zeros [N, groups] and scales [N, groups].

    Returns {"qweight": int32 [K, N/8], "qzeros": int32 [groups, N/8], "scales": float16 [groups, N]}; within each
    run of 8 output columns, column AWQ_ORDER[j] goes to nibble slot j.
    """
    n = q.shape[0]
    # Reorder the output columns so that a plain sequential pack along N lands them in AWQ's slots.
    order = (torch.arange(n).view(-1, 8)[:, list(AWQ_ORDER)]).reshape(-1)
    return {
        "qweight": _pack_rows(q.t()[:, order], 4, along_columns=True),
        "qzeros": _pack_rows(zeros.t()[:, order], 4, along_columns=True),
        "scales": scales.t().to(torch.float16),
    }


def _pack_rows(values: torch.Tensor, bits: int, along_columns: bool = False) -> torch.Tensor:
    """Pack unsigned `bits`-wide ints: consecutive rows (or columns) i*P + j go to bit offset bits*j of word i."""
    per_word = 32 // bits
    mask = 2**bits - 1
    v = values.to(torch.int64)
    if along_columns:
        v = v.t()
    if int(v.min()) < 0 or int(v.max()) > mask:
        raise ValueError(f"values outside [0, {mask}] cannot be packed in {bits} bits")
    rows = v.shape[0] // per_word
    words = torch.zeros(rows, v.shape[1], dtype=torch.int64)
    for j in range(per_word):
        words |= v[j::per_word] << (bits * j)
    # Words are unsigned 32-bit patterns; store them as the int32 with the same bits (two's complement).
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.t().contiguous() if along_columns else words


def _nonzero(scales: torch.Tensor) -> torch.Tensor:
    """An all-zero group would get step 0; any positive step dequantizes it to zeros exactly."""
    return torch.where(scales > 0, scales, torch.ones_like(scales))


def _round_up_half(scales: torch.Tensor) -> torch.Tensor:
    """`scales` in float16, each rounded up (never down) to a representable value."""
    half = scales.to(torch.float16)
    below = half.float() < scales
    return torch.where(below, torch.nextafter(half, torch.tensor(float("inf"), dtype=torch.float16)), half)


def _input_key(prefix: str) -> str:
    """Projections that read the same input share this key (a layer's q/k/v, its gate/up)."""
    head, _, name = prefix.rpartition(".")
    shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    return f"{head}.{shared.get(name, name)}"


def _quantized(prefix: str, lm_head: bool) -> bool:
    """Whether the weight of the module `prefix` is quantized: every decoder projection, and the LM head with
    `lm_head`."""
    return _is_projection(prefix) or (lm_head and prefix == "lm_head")


def _is_projection(prefix: str) -> bool:
    """Whether `prefix` names a decoder projection: model.layers.<N>.<one of PROJECTIONS>."""
    parts = prefix.split(".", 3)
    return len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and parts[3] in PROJECTIONS


def _check_arguments(method: str, bits: int, desc_act: bool, sym: bool, lm_head: bool) -> None:
    if lm_head and method != "gptq":
        raise ValueError(f"only gptq checkpoints are built with a quantized LM head, not {method}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    if method == "gptq" and bits not in (4, 8):
        raise ValueError(f"gptq checkpoints are built with 4 or 8 bits, not {bits}")
    if method == "awq" and (bits != 4 or desc_act or not sym):
        raise ValueError("awq checkpoints are 4-bit, without act order, and always asymmetric (leave sym=True)")


def _check_shape(name: str, method: str, bits: int, n: int, k: int, g: int) -> None:
    """The packed layouts need whole words along both packed dimensions and whole groups along K."""
    per_word = 32 // bits
    if k % g:
        raise ValueError(f"{name}: input size {k} is not a multiple of the group size {g}")
    if n % per_word or (method == "gptq" and k % per_word):
        raise ValueError(f"{name}: shape [{n}, {k}] cannot be packed {per_word} values to an int32")


def _load_weights(src: Path) -> dict[str, torch.Tensor]:
    """All tensors of `src`, from model.safetensors or the shards a model.safetensors.index.json lists."""
    single = src / "model.safetensors"
    if single.is_file():
        return load_file(str(single))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        weights.update(load_file(str(src / shard)))
    return weights


def _read_source_stamp(src: Path) -> Any:
    """The source's own build stamp (textgen_server.builder's), so a rebuilt source invalidates the cache."""
    stamp = src / builder.STAMP
    return json.loads(stamp.read_text()) if stamp.is_file() else None
