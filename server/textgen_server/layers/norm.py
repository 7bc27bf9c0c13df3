"""RMSNorm as Llama-family models define it: normalise in fp32, cast back, then scale."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from textgen_server.layers.cpu_ops import ops_for


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        # textgen::rms_norm / add_rms_norm (fused_ops.cpp): one call where torch's takes six to ten small ops.
        self.fused = ops_for(weight.dtype, weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.is_contiguous():
            return torch.ops.textgen.rms_norm(x, self.weight, self.eps)
        # The scale is applied after the cast back, as the reference does, so half-precision results round the
        # same way.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, its norm): a decoder layer's residual connection and the next norm, in one op."""
        if self.fused and x.is_contiguous() and residual.is_contiguous():
            return torch.ops.textgen.add_rms_norm(x, residual, self.weight, self.eps)
        total = x + residual
        return total, self(total)
