"""Watermarking ("A Watermark for Large Language Models", Kirchenbauer et al. 2023), as TGI applies it.

Before each choice, a "green list" of gamma * vocab token ids is drawn from an RNG seeded with
15485863 * previous token id, and delta is added to their scores. A detector that knows the hash key can
then count green tokens. gamma and delta come from the shard's environment: WATERMARK_GAMMA (0.5) and
WATERMARK_DELTA (2.0), which the launcher sets from --watermark-gamma / --watermark-delta.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

HASH_KEY = 15485863  # a large prime, the paper's (and TGI's) key


class Watermark:
    """Adds delta to each row's green list; the green list depends only on that row's previous token."""

    def __init__(self, device: torch.device, gamma: float | None = None, delta: float | None = None) -> None:
        self.gamma = float(os.environ.get("WATERMARK_GAMMA", "0.5")) if gamma is None else gamma
        self.delta = float(os.environ.get("WATERMARK_DELTA", "2.0")) if delta is None else delta
        self.device = device
        self._rng = torch.Generator(device=device)

    def green_list(self, previous_id: int, vocab_size: int) -> Tensor:
        """The ids favoured after `previous_id`: the first gamma * vocab ids of a seeded permutation."""
        self._rng.manual_seed(HASH_KEY * previous_id)
        permutation = torch.randperm(vocab_size, generator=self._rng, device=self.device)
        return permutation[: int(vocab_size * self.gamma)]

    def __call__(self, scores: Tensor, previous_ids: Tensor) -> Tensor:
        """scores [R, V], previous_ids [R] -> scores with delta added to each row's green list."""
        vocab_size = scores.shape[-1]
        bias = torch.zeros_like(scores)
        # One seeded permutation per row is inherent to the scheme; only watermarked rows come here.
        for row, previous_id in enumerate(previous_ids.tolist()):
            bias[row, self.green_list(previous_id, vocab_size)] = self.delta
        return scores + bias
