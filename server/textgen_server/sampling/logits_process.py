"""Vectorised logits processors and warpers, one class per TGI parameter.

Each object is built for a set of batch rows and holds one parameter value per row ([R, 1] tensors so that
they broadcast over the vocabulary). The chooser in `chooser.py` hands each one only the rows that asked for
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


# A full sort of a 32k vocabulary costs several top-256s on CPU, and real nucleus / typical sets are usually
# much smaller, so the sort-based warpers first look at the best FIRST_LOOK tokens and sort everything only
# when some row's set turns out to be wider.
FIRST_LOOK = 256


def _widths(vocab_size: int) -> tuple[int, ...]:
    return (FIRST_LOOK, vocab_size) if vocab_size > FIRST_LOOK else (vocab_size,)


class TopP:
    """Nucleus sampling: keeps the best tokens while the mass of the tokens better than them is < top_p.

    (The same set as dropping the worst tokens whose cumulative mass stays <= 1 - top_p; the best token
    always survives. Tokens tied with the last kept one are kept too.)
    """

    def __init__(self, top_p: Tensor) -> None:
        self.top_p = _column(top_p)

    def __call__(self, scores: Tensor) -> Tensor:
        probs = scores.softmax(dim=-1)
        vocab_size = scores.shape[-1]
        for width in _widths(vocab_size):
            best, _ = probs.topk(width, dim=-1)
            # the set ends inside the first `width` tokens once their mass reaches top_p
            if width == vocab_size or bool((best.sum(dim=-1, keepdim=True) >= self.top_p).all()):
                break
        mass_before = best.cumsum(dim=-1) - best
        kept = (mass_before < self.top_p).sum(dim=-1, keepdim=True)  # >= 1: nothing is before the best
        threshold = best.gather(-1, kept - 1)
        return scores.masked_fill(probs < threshold, NEG_INF)


class TypicalP:
    """Locally typical sampling: keeps the tokens whose surprisal is closest to the entropy, closest first,
    up to and including the one that brings their mass to typical_p."""

    def __init__(self, typical_p: Tensor) -> None:
        self.mass = _column(typical_p)

    def __call__(self, scores: Tensor) -> Tensor:
        logp = scores.log_softmax(dim=-1)
        probs = scores.softmax(dim=-1)  # not logp.exp(): exp of very negative values is slow on CPU
        # nansum: masked tokens give 0 * -inf = nan and contribute nothing to the entropy.
        entropy = -(probs * logp).nansum(dim=-1, keepdim=True)
        distance = (-logp - entropy).abs()
        vocab_size = scores.shape[-1]
        for width in _widths(vocab_size):
            neg_closest, order = (-distance).topk(width, dim=-1)
            cumulative = probs.gather(-1, order).cumsum(dim=-1)
            crossing = (cumulative < self.mass).sum(dim=-1, keepdim=True)  # the token reaching the mass
            if width == vocab_size or bool((crossing < width).all()):
                break
        threshold = -neg_closest.gather(-1, crossing.clamp(max=width - 1))
        return scores.masked_fill(distance > threshold, NEG_INF)
