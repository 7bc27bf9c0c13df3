"""y = x @ W^T + b on 4-bit weights kept packed: torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`).

The kernel reads 4 bits a weight and dequantizes in registers, W = (q - 8) * scale + offset per group of G
consecutive input features, so a checkpoint's (q - zero) * scale is fed as scale and offset = (8 - zero) * scale.
Act-order checkpoints (GPTQ `desc_act`), whose groups are scattered over the input features, are served by
permuting the input features once at load (the groups become consecutive) and the activations' columns the same
way at each call.

Where it serves: bfloat16 activations. Its float32 path is a scalar fallback, 6x slower than F.linear on the
dequantized weight at one row on the 2-core Zen 3 (benchmark/README.md, "Quantized models"), so float32 shards
dequantize at load instead (`serves` is False). The kernel also needs N a multiple of 16, G one of 32, 64, 128 or
256, and 4 bits.
"""

from __future__ import annotations

import torch

from textgen_server.layers.linear_choice import Kernel
from textgen_server.layers.quantization import QuantizedWeight

GROUP_SIZES = (32, 64, 128, 256)
# The kernel's K tiling, as torch's int4 weight-only quantization (torchao) packs for CPUs.
INNER_K_TILES = 2


def why_not(weight: QuantizedWeight) -> str | None:
    """Why the int4 kernel cannot compute this weight, or None when it can."""
    n, k = weight.shape
    if weight.q.device.type != "cpu":
        return f"a {weight.q.device.type} device (the kernel is torch's CPU one)"
    if weight.scales.dtype != torch.bfloat16:
        return f"{weight.scales.dtype} activations (the kernel runs bfloat16 only at speed)"
    if weight.bits != 4:
        return f"{weight.bits}-bit weights"
    if weight.group_size not in GROUP_SIZES or k % weight.group_size or n % 16:
        return f"shape {n}x{k} with groups of {weight.group_size}"
    if _consecutive_groups(weight) is None:
        return "act-order groups of unequal sizes in this shard's input features"
    return None


def _consecutive_groups(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the input-feature order that makes every group G consecutive features, each block's group id), or None."""
    order = torch.argsort(weight.g_idx, stable=True)
    blocks = weight.g_idx[order].view(-1, weight.group_size)
    if not bool((blocks == blocks[:, :1]).all()) or blocks[:, 0].unique().numel() != blocks.shape[0]:
        return None
    return order, blocks[:, 0]


class Int4Kernel(Kernel):
    """The packed weight and its per-group scale and offset; a kernel of linear_choice's kind, built from a
    quantized weight instead of a float one."""

    path = "int4"

    @staticmethod
    def available(dtype: torch.dtype, device: torch.device) -> bool:
        return dtype == torch.bfloat16 and device.type == "cpu"

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        reason = why_not(weight)
        if reason is not None:
            raise ValueError(f"the int4 kernel cannot serve this weight: {reason}")
        consecutive = _consecutive_groups(weight)
        assert consecutive is not None
        order, groups = consecutive
        self.order = None if bool((order == torch.arange(order.numel())).all()) else order
        q = weight.q if self.order is None else weight.q[:, order]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), INNER_K_TILES)
        scales, zeros = weight.scales.float()[:, groups], weight.zeros.float()[:, groups]
        # [groups, N, 2]: the scale and the offset of each group and output feature
        self.scales_offsets = torch.stack([scales, (8 - zeros) * scales], dim=-1).transpose(0, 1).contiguous()
        self.scales_offsets = self.scales_offsets.to(weight.scales.dtype)
        self.group_size = weight.group_size
        self.in_features = weight.shape[1]
        super().__init__(self.packed, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.order is not None:
            rows = rows[:, self.order]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows.contiguous(), self.packed, self.group_size, self.scales_offsets
        )
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], out.shape[-1])
