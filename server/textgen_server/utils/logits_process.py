"""Vectorised logits processors and warpers, one class per TGI parameter.

Each object is built for a set of batch rows and holds one parameter value per row ([R, 1] tensors so that
they broadcast over the vocabulary). The chooser in `tokens.py` hands each one only the rows that asked for
it, so a row left at its default value is never touched. Every call is out of place: the caller's logits
stay untouched (the shard reads the raw logits again for top-n tokens).
"""
from __future__ import annotations

import torch
from torch import Tensor

NEG_INF = float("-inf")


def _column(values: Tensor) -> Tensor:
    """[R] -> [R, 1], so one value per row broadcasts over the vocabulary."""
    return values.reshape(-1, 1)


class RepetitionPenalty:
    """CTRL-style penalty on every token already in the row's history (prompt + generated).

    A seen token's score is divided by the penalty when positive and multiplied by it when negative, so a
    penalty > 1 always makes seen tokens less likely and < 1 more likely.
    """

    def __init__(self, penalty: Tensor) -> None:
        self.penalty = _column(penalty)

    def __call__(self, scores: Tensor, counts: Tensor) -> Tensor:
        penalised = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
        return torch.where(counts > 0, penalised, scores)


class FrequencyPenalty:
    """Subtracts penalty * (occurrences of the token / length of the row's history) from each score.

    The history is normalised by its length as TGI's heterogeneous (flash) chooser does.
    """

    def __init__(self, penalty: Tensor) -> None:
        self.penalty = _column(penalty)

    def __call__(self, scores: Tensor, counts: Tensor) -> Tensor:
        lengths = counts.sum(dim=-1, keepdim=True).clamp(min=1)
        return scores - self.penalty * counts / lengths


class Temperature:
    """Divides the scores: > 1 flattens the distribution, < 1 sharpens it."""

    def __init__(self, temperature: Tensor) -> None:
        self.temperature = _column(temperature)

    def __call__(self, scores: Tensor) -> Tensor:
        return scores / self.temperature


class TopK:
    """Keeps, per row, the tokens scoring at least the k-th best score (ties at the k-th are all kept)."""

    def __init__(self, top_k: Tensor, vocab_size: int) -> None:
        k = top_k.long().clamp(min=1, max=vocab_size)
        self.max_k = int(k.max())
        self.kth_index = _column(k - 1)

    def __call__(self, scores: Tensor) -> Tensor:
        # One topk over the largest k serves every row; each row then reads its own k-th value.
        top = torch.topk(scores, min(self.max_k, scores.shape[-1]), dim=-1).values
        kth = top.gather(-1, self.kth_index.clamp(max=top.shape[-1] - 1))
        return scores.masked_fill(scores < kth, NEG_INF)


def _keep_by_cumulative_mass(scores: Tensor, order: Tensor, remove_sorted: Tensor) -> Tensor:
    """Scatter a removal mask computed in `order` back to vocabulary order and mask those tokens."""
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return scores.masked_fill(remove, NEG_INF)


class TopP:
    """Nucleus sampling: keeps the smallest set of best tokens whose probability mass reaches top_p."""

    def __init__(self, top_p: Tensor) -> None:
        self.drop_mass = _column(1.0 - top_p)

    def __call__(self, scores: Tensor) -> Tensor:
        ascending, order = scores.sort(dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        # Tokens whose cumulative mass (counted from the worst) stays within 1 - top_p are dropped.
        remove_sorted = cumulative <= self.drop_mass
        remove_sorted[:, -1] = False  # the best token always survives
        return _keep_by_cumulative_mass(scores, order, remove_sorted)


class TypicalP:
    """Locally typical sampling: keeps the tokens whose surprisal is closest to the entropy, up to mass p."""

    def __init__(self, typical_p: Tensor) -> None:
        self.mass = _column(typical_p)

    def __call__(self, scores: Tensor) -> Tensor:
        logp = scores.log_softmax(dim=-1)
        # nansum: masked tokens give 0 * -inf = nan and contribute nothing to the entropy.
        entropy = -(logp.exp() * logp).nansum(dim=-1, keepdim=True)
        shifted = (-logp - entropy).abs()
        shifted_sorted, order = shifted.sort(dim=-1)
        cumulative = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
        last_kept = (cumulative < self.mass).sum(dim=-1, keepdim=True).clamp(max=scores.shape[-1] - 1)
        remove_sorted = shifted_sorted > shifted_sorted.gather(-1, last_kept)
        return _keep_by_cumulative_mass(scores, order, remove_sorted)
