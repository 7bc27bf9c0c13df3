"""Watermark: a green list seeded by the previous token gets +delta; gamma/delta come from the env."""

from __future__ import annotations

import pytest
import torch

from textgen_server.sampling.watermark import Watermark

CPU = torch.device("cpu")


def test_green_list_is_gamma_of_vocab_and_depends_only_on_previous_token() -> None:
    wm = Watermark(CPU, gamma=0.25, delta=1.0)
    green = wm.green_list(7, 100)
    assert green.numel() == 25 and green.unique().numel() == 25
    assert torch.equal(wm.green_list(7, 100), green)
    assert not torch.equal(wm.green_list(8, 100), green)


def test_delta_is_added_to_each_rows_green_list_only() -> None:
    wm = Watermark(CPU, gamma=0.5, delta=2.0)
    scores = torch.randn(2, 64)
    previous = torch.tensor([3, 11])
    out = wm(scores, previous)
    for row, prev in enumerate(previous.tolist()):
        is_green = torch.zeros(64, dtype=torch.bool)
        is_green[wm.green_list(prev, 64)] = True
        assert torch.allclose(out[row][is_green], scores[row][is_green] + 2.0)
        assert torch.equal(out[row][~is_green], scores[row][~is_green])


def test_watermark_raises_green_probability_mass() -> None:
    wm = Watermark(CPU, gamma=0.5, delta=2.0)
    scores = torch.zeros(1, 1000)
    green = wm.green_list(42, 1000)
    probs = wm(scores, torch.tensor([42])).softmax(-1)
    assert probs[0, green].sum() > 0.85  # e^2 / (1 + e^2) = 0.88 of the mass with gamma 0.5


def test_gamma_and_delta_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATERMARK_GAMMA", "0.1")
    monkeypatch.setenv("WATERMARK_DELTA", "5.0")
    wm = Watermark(CPU)
    assert (wm.gamma, wm.delta) == (0.1, 5.0)
    assert wm.green_list(1, 200).numel() == 20
    monkeypatch.delenv("WATERMARK_GAMMA")
    monkeypatch.delenv("WATERMARK_DELTA")
    assert (Watermark(CPU).gamma, Watermark(CPU).delta) == (0.5, 2.0)
