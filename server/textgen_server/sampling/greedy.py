"""A greedy batch's choice by the fused C++ op `textgen::greedy_pick` (layers/token_ops.cpp): each row's argmax
and its log_softmax entry in one pass, without the [B, V] log_softmax matrix.

The op is built and loaded with the shard's other CPU ops (layers/cpu_ops.py: TEXTGEN_CPU_DECODE_KERNEL=0 turns it
off); this module decides when the chooser may call it. It must give torch's bits, so it serves only where it was
compiled for the vector path torch's own log_softmax takes at run time (ATEN_CPU_CAPABILITY can change it):
elsewhere the chooser keeps its torch code.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from textgen_server.layers.cpu_ops import ops_for


def greedy_pick_for(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a greedy batch's logits of `dtype` on `device` go to textgen::greedy_pick: as `ops_for`, and the op
    compiled for the vector path torch's own log_softmax takes at run time, whose bits it reproduces."""
    return ops_for(dtype, device) and _same_vectors_as_torch()


@functools.cache
def _same_vectors_as_torch() -> bool:
    return bool(torch.ops.textgen.greedy_pick_capability() == torch.backends.cpu.get_cpu_capability())


def greedy_pick(scores: Tensor) -> tuple[Tensor, Tensor]:
    """(ids [B] int64, logprobs [B] float32) of `scores` [B, V]: max's indices and log_softmax's entries at them,
    as torch gives them. Only where `greedy_pick_for(scores.dtype, scores.device)`."""
    ids, logprobs = torch.ops.textgen.greedy_pick(scores.contiguous())  # the op reads rows of V contiguous values
    return ids, logprobs
