"""A quantized checkpoint's form as textgen serves it: `QuantConfig` (how its projections are quantized) and
`QuantizedWeight` (one projection's weight as integers, one byte a weight, whatever layout the file packed it in),
which tensor parallelism slices and the packed kernels (layers/quant_kernels.py) repack. The file formats that
produce them: layers/quantization.py (GPTQ, AWQ, eetq) and layers/ct_format.py (compressed-tensors).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from textgen_server.config import UnsupportedConfigError


@dataclass(frozen=True)
class QuantConfig:
    """How a checkpoint's projections are quantized (the fields TGI reads from `quantization_config`)."""

    method: str  # "gptq" | "awq" | "eetq" | "compressed-tensors"
    bits: int
    group_size: int  # -1: one group per output feature (per channel)
    desc_act: bool = False
    sym: bool = True
    # GPTQ/AWQ: names a module's name contains; compressed-tensors: its `ignore` list (layers/ct_format.py)
    modules_to_not_convert: tuple[str, ...] = ()
    format: str | None = None  # compressed-tensors' format

    def quantizes(self, prefix: str) -> bool:
        """Whether the projection at `prefix` is stored quantized: not named in `modules_to_not_convert` (a part of
        the module's name for GPTQ/AWQ; for compressed-tensors' `ignore`, the exact name or a `re:` pattern that
        matches it whole)."""
        if self.method == "compressed-tensors":
            return not any(
                re.fullmatch(entry[3:], prefix) if entry.startswith("re:") else entry == prefix
                for entry in self.modules_to_not_convert
            )
        return not any(name in prefix for name in self.modules_to_not_convert)


@dataclass
class QuantizedWeight:
    """One projection's weight as integers: W[n, k] = (q[n, k] - zeros[n, g_idx[k]]) * scales[n, g_idx[k]].

    `q` uint8 [N, K]; `zeros` and `scales` [N, groups] (zeros as small integers in the scales' dtype); `g_idx`
    int64 [K]; `group_size` the features of a group (K for one group per output feature). Slicing rows (output
    features) or columns (input features) keeps every group a column uses.
    """

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor
    bits: int
    group_size: int
    # compressed-tensors W8A8: the input activations are quantized to int8 per token at run time
    dynamic_activations: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        return dataclasses.replace(
            self, q=self.q[start:stop], zeros=self.zeros[start:stop], scales=self.scales[start:stop]
        )

    def cols(self, start: int, stop: int) -> QuantizedWeight:
        # A per-channel weight's one group spans whatever columns this part keeps.
        group = min(self.group_size, stop - start)
        return dataclasses.replace(self, q=self.q[:, start:stop], g_idx=self.g_idx[start:stop], group_size=group)

    @staticmethod
    def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Projections of one input stacked on their outputs (q/k/v, gate/up): one matmul.

        Their input features must share one grouping: the same g_idx (always so without act-order).
        """
        first = parts[0]
        if any(not torch.equal(p.g_idx, first.g_idx) or p.group_size != first.group_size for p in parts):
            raise UnsupportedConfigError(
                "projections of one input quantized with different act-order groupings (g_idx) are not supported"
            )
        return dataclasses.replace(
            first,
            q=torch.cat([p.q for p in parts]),
            zeros=torch.cat([p.zeros for p in parts]),
            scales=torch.cat([p.scales for p in parts]),
        )

    @staticmethod
    def per_channel_int8(weight: torch.Tensor) -> QuantizedWeight:
        """`weight` [N, K] quantized as eetq does: symmetric int8 (stored + 128), one scale = max |w| / 127 per
        output feature, rounded to nearest; computed in float32, the scales kept in `weight`'s dtype."""
        w = weight.float()
        scales = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        scales = scales.to(weight.dtype)  # the integers are rounded against the scale the kernel will use
        ints = torch.round(w / scales.float()).clamp(-127, 127)
        return QuantizedWeight(
            (ints + 128).to(torch.uint8),
            torch.full_like(scales, 128),
            scales,
            torch.zeros(w.shape[1], dtype=torch.long),
            8,
            w.shape[1],
        )

    def dequantize(self) -> torch.Tensor:
        """W in the scales' dtype, computed in float32."""
        groups = self.g_idx
        w = (self.q.float() - self.zeros.float()[:, groups]) * self.scales.float()[:, groups]
        return w.to(self.scales.dtype)


def unpack(words: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words -> the unsigned `bits`-bit values they hold, laid out along `dim` (value j of a word at
    position word * per_word + order[j], `order` the identity by default)."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    # Shifting a negative int32 right fills with ones: the mask keeps only the field's bits.
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per_word], field j of each word
    if order is not None:
        fields = fields[..., torch.tensor(order).argsort()]  # position p holds the field whose order is p
    fields = fields.movedim(-1, dim + 1) if dim == 0 else fields
    shape = list(words.shape)
    shape[dim] *= per_word
    return fields.reshape(shape).to(torch.uint8)
