"""Each logits processor / warper changes the distribution the way its parameter promises."""

from __future__ import annotations

import math

import pytest
import torch

from textgen_server.sampling.logits_process import (
    FrequencyPenalty,
    RepetitionPenalty,
    Temperature,
    TopK,
    TopP,
    TypicalP,
)


def kept(scores: torch.Tensor) -> list[set[int]]:
    """The ids left finite in each row."""
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in scores]


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def entropy(scores: torch.Tensor) -> torch.Tensor:
    logp = scores.log_softmax(-1)
    return -(logp.exp() * logp).nansum(-1)


def test_temperature_sharpens_below_one_and_flattens_above() -> None:
    scores = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(3, 1)
    out = Temperature(torch.tensor([0.5, 1.0, 2.0]))(scores)
    assert torch.allclose(out[0], scores[0] * 2) and torch.equal(out[1], scores[1])
    h = entropy(out)
    assert h[0] < h[1] < h[2]
    assert torch.equal(out.argmax(-1), scores.argmax(-1))  # the order of tokens never changes


def test_top_k_keeps_k_best_per_row_and_ties_at_the_kth() -> None:
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.3, 0.7], [0.1, 0.9, 0.5, 0.5, 0.7], [1.0, 2.0, 3.0, 4.0, 5.0]])
    out = TopK(torch.tensor([2, 3, 99]), vocab_size=5)(scores)
    assert kept(out) == [{1, 4}, {1, 4, 2, 3}, {0, 1, 2, 3, 4}]
    assert torch.equal(out[0, [1, 4]], scores[0, [1, 4]])  # survivors keep their scores


def test_top_p_keeps_the_smallest_nucleus_reaching_p() -> None:
    scores = logits_of([0.5, 0.3, 0.15, 0.05]).repeat(4, 1)
    out = TopP(torch.tensor([0.45, 0.7, 0.9, 1e-6]))(scores)
    assert kept(out) == [{0}, {0, 1}, {0, 1, 2}, {0}]


def test_top_p_of_one_keeps_everything() -> None:
    scores = logits_of([0.4, 0.3, 0.2, 0.1])
    assert kept(TopP(torch.tensor([1.0]))(scores)) == [{0, 1, 2, 3}]


def typical_set(probs: list[float], mass: float) -> set[int]:
    """Reference: order tokens by |surprisal - entropy|, keep until the kept mass reaches `mass`."""
    h = -sum(p * math.log(p) for p in probs)
    order = sorted(range(len(probs)), key=lambda i: abs(-math.log(probs[i]) - h))
    chosen: set[int] = set()
    total = 0.0
    for i in order:
        chosen.add(i)
        total += probs[i]
        if total >= mass:
            break
    return chosen


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.8, 0.95])
def test_typical_p_keeps_tokens_closest_to_the_entropy(mass: float) -> None:
    probs = [0.45, 0.25, 0.15, 0.1, 0.05]
    out = TypicalP(torch.tensor([mass]))(logits_of(probs))
    assert kept(out) == [typical_set(probs, mass)]


def test_typical_p_ignores_already_masked_tokens() -> None:
    scores = torch.tensor([[2.0, 1.0, float("-inf"), 0.5]])
    out = TypicalP(torch.tensor([0.9]))(scores)
    assert 2 not in kept(out)[0] and len(kept(out)[0]) >= 1


def reference_top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Straight from the definition: sort ascending, drop the tail whose cumulative mass <= 1 - top_p."""
    ascending, order = scores.double().sort(dim=-1)
    remove = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
    remove[:, -1] = False
    return scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))


def reference_typical_p(scores: torch.Tensor, mass: float) -> torch.Tensor:
    logp = scores.double().log_softmax(-1)
    distance = (-logp - -(logp.exp() * logp).nansum(-1, keepdim=True)).abs()
    ordered, order = distance.sort(dim=-1)
    cumulative = logp.exp().gather(-1, order).cumsum(-1)
    last = (cumulative < mass).sum(-1, keepdim=True).clamp(max=scores.shape[-1] - 1)
    remove = ordered > ordered.gather(-1, last)
    return scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))


@pytest.mark.parametrize("scale", [0.1, 1.0, 8.0])  # flat (sets wider than the first look) to peaked
def test_top_p_and_typical_p_match_the_full_sort_definition(scale: float) -> None:
    scores = torch.randn(6, 2000, generator=torch.Generator().manual_seed(1)) * scale
    for p in (0.3, 0.9):
        column = torch.full((6,), p)
        assert kept(TopP(column)(scores)) == kept(reference_top_p(scores, p))
        assert kept(TypicalP(column)(scores)) == kept(reference_typical_p(scores, p))


def test_repetition_penalty_lowers_seen_tokens_either_sign() -> None:
    scores = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    counts = torch.tensor([[1.0, 3.0, 0.0, 0.0]])
    out = RepetitionPenalty(torch.tensor([2.0]))(scores, counts)
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0]]
    # < 1 rewards repetition instead
    out = RepetitionPenalty(torch.tensor([0.5]))(scores, counts)
    assert out.tolist() == [[4.0, -1.0, 2.0, -2.0]]


def test_frequency_penalty_scales_with_share_of_history() -> None:
    scores = torch.zeros(2, 4)
    counts = torch.tensor([[3.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    out = FrequencyPenalty(torch.tensor([1.0, 2.0]))(scores, counts)
    assert out[0].tolist() == [-0.75, -0.25, 0.0, 0.0]
    assert out[1].tolist() == [0.0] * 4  # empty history: no division by zero
    # a negative penalty encourages seen tokens
    assert FrequencyPenalty(torch.tensor([-1.0]))(scores[:1], counts[:1])[0, 0] == 0.75


def test_processors_do_not_modify_their_input() -> None:
    scores = torch.randn(2, 50)
    before = scores.clone()
    counts = torch.ones(2, 50)
    for warp in (
        Temperature(torch.tensor([0.5, 2.0])),
        TopK(torch.tensor([3, 4]), 50),
        TopP(torch.tensor([0.5, 0.9])),
        TypicalP(torch.tensor([0.5, 0.9])),
    ):
        warp(scores)
    RepetitionPenalty(torch.tensor([1.5, 2.0]))(scores, counts)
    FrequencyPenalty(torch.tensor([1.0, 2.0]))(scores, counts)
    assert torch.equal(scores, before)
