"""HeterogeneousNextTokenChooser and batch_top_tokens: the batch-level token choice contract."""

from __future__ import annotations

import math

import pytest
import torch

from textgen_pb import generate_pb2
from textgen_server.layers.cpu_ops import ENV_SWITCH
from textgen_server.sampling.chooser import HeterogeneousNextTokenChooser, batch_top_tokens
from textgen_server.sampling.greedy import greedy_pick_for
from textgen_server.sampling.watermark import Watermark

CPU = torch.device("cpu")
V = 50


def params(**overrides: object) -> generate_pb2.NextTokenChooserParameters:
    """The router's defaults (proto zero values are not valid parameters), with overrides."""
    values: dict[str, object] = dict(temperature=1.0, top_k=0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0)
    values.update(overrides)
    return generate_pb2.NextTokenChooserParameters(**values)


def chooser(
    rows: list[generate_pb2.NextTokenChooserParameters], prompts: list[list[int]] | None = None
) -> HeterogeneousNextTokenChooser:
    return HeterogeneousNextTokenChooser.from_pb(rows, prompts or [[1, 2, 3]] * len(rows), V, CPU)


def logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, V, generator=torch.Generator().manual_seed(seed)) * 3


def chosen(logprobs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each row's entry of `logprobs` [B, V] at its id."""
    return logprobs.gather(1, ids.unsqueeze(1)).squeeze(1)


def last(batch: int) -> torch.Tensor:
    return torch.full((batch,), 3, dtype=torch.long)


def generate(c: HeterogeneousNextTokenChooser, steps: int, seed: int = 0) -> list[list[int]]:
    """Run `steps` choices on fresh logits (same logits for every row) and return each row's tokens."""
    out: list[list[int]] = [[] for _ in range(len(c))]
    ids = last(len(c))
    for step in range(steps):
        ids, _, _ = c(ids, logits(1, seed * 1000 + step).expand(len(c), V))
        for row, token in enumerate(ids.tolist()):
            out[row].append(token)
    return out


SAMPLING = dict(do_sample=True, seed=1234)
EVERYTHING = dict(
    do_sample=True,
    seed=99,
    temperature=0.7,
    top_k=20,
    top_p=0.9,
    typical_p=0.95,
    repetition_penalty=1.3,
    frequency_penalty=0.5,
    watermark=True,
)


def test_default_rows_are_greedy_with_raw_logprobs() -> None:
    c = chooser([params(), params(do_sample=False)])
    scores = logits(2)
    before = scores.clone()
    ids, logprobs, _ = c(last(2), scores)
    assert ids.tolist() == scores.argmax(-1).tolist()
    assert torch.equal(logprobs, chosen(scores.log_softmax(-1), ids))
    assert torch.equal(scores, before)  # the caller's logits are not modified
    assert c.do_sample == [False, False] and ids.dtype == torch.long


@pytest.mark.parametrize("ops", ["1", "0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ids_and_logprobs_are_torch_s_bits_with_and_without_the_op(
    ops: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_SWITCH, ops)
    width = 1004  # whole vectors and a partial one, of 16 lanes or of 8
    c = HeterogeneousNextTokenChooser.from_pb([params()] * 5, [[1]] * 5, width, CPU)
    scores = (torch.randn(5, width, generator=torch.Generator().manual_seed(3)) * 8).to(dtype)
    scores[1, 500] = scores[1, 900] = scores[1].max() + 1  # a tie
    with torch.profiler.profile() as prof:
        ids, logprobs, _ = c(last(5), scores)
    ran = any(event.name == "textgen::greedy_pick" for event in prof.events())
    assert ran == greedy_pick_for(dtype, CPU)  # where the op gives torch's bits on this machine
    assert not (ran and ops == "0")
    expected = scores.float().max(-1).indices
    assert torch.equal(ids, expected)
    assert torch.equal(logprobs, chosen(scores.float().log_softmax(-1), expected))
    assert ids[1] == 500 and logprobs.dtype == torch.float32


@pytest.mark.parametrize("with_sampling_row", [False, True])
def test_greedy_rows_take_the_first_maximum_or_a_nan_as_argmax_does(with_sampling_row: bool) -> None:
    scores = torch.zeros(3, V)
    scores[0, [7, 30]] = 5.0  # a tie: the first one wins
    scores[1, [4, 9]] = float("nan")
    scores[2, 11] = float("inf")
    rows = [params()] * 3 + ([params(do_sample=True, seed=1)] if with_sampling_row else [])
    scores = torch.cat([scores, logits(len(rows) - 3)])
    ids, _, _ = chooser(rows)(last(len(rows)), scores)
    assert ids[:3].tolist() == scores[:3].argmax(-1).tolist() == [7, 4, 11]


@pytest.mark.parametrize(
    "overrides", [dict(do_sample=True), dict(temperature=0.9), dict(top_k=5), dict(top_p=0.9), dict(typical_p=0.9)]
)
def test_a_row_samples_if_asked_or_if_any_warper_is_set(overrides: dict[str, object]) -> None:
    assert chooser([params(), params(seed=5, **overrides)]).do_sample == [False, True]


def test_seeds_are_reported_per_row() -> None:
    assert chooser([params(seed=7), params(do_sample=True, seed=2**64 - 1)]).seeds == [7, 2**64 - 1]


def test_logprobs_are_those_of_the_processed_scores() -> None:
    c = chooser([params(temperature=0.5, seed=1), params()])
    scores = logits(2)
    assert torch.allclose(c.process(last(2), scores), torch.stack([scores[0] / 0.5, scores[1]]))
    ids, logprobs, chosen_from = c(last(2), scores)
    assert torch.allclose(logprobs[0], (scores[0] / 0.5).log_softmax(-1)[ids[0]])
    assert torch.allclose(logprobs[1], scores[1].log_softmax(-1)[ids[1]])
    assert torch.equal(chosen_from, c.process(last(2), scores))  # handed back for the top-n tokens


@pytest.mark.parametrize("ops", ["1", "0"])
def test_a_batch_no_processor_touches_hands_back_the_caller_s_logits(ops: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No copy when nothing applies (the greedy op's path where it is built): the logits are the scores."""
    monkeypatch.setenv(ENV_SWITCH, ops)
    scores = logits(2)
    assert chooser([params(), params()])(last(2), scores).scores is scores
    penalised = chooser([params(), params(repetition_penalty=2.0)])
    processed = penalised.process(last(2), scores)  # before the call records its choice in the history
    assert torch.equal(penalised(last(2), scores).scores, processed)


def test_top_k_one_equals_greedy() -> None:
    c = chooser([params(top_k=1, do_sample=True, seed=s) for s in range(4)] + [params()])
    tokens = generate(c, 8)
    assert all(row == tokens[-1] for row in tokens)


def test_same_seed_same_tokens_alone_or_batched_with_anything() -> None:
    alone = generate(chooser([params(**SAMPLING)]), 10)[0]
    batched = generate(chooser([params(), params(**EVERYTHING), params(**SAMPLING), params(seed=3, top_p=0.5)]), 10)
    assert batched[2] == alone
    assert generate(chooser([params(**SAMPLING)]), 10)[0] == alone  # and reproducible run to run
    other_seed = generate(chooser([params(do_sample=True, seed=4321)]), 10)[0]
    assert other_seed != alone


def test_seeded_sampling_survives_filter_and_concatenate() -> None:
    reference = generate(chooser([params(**SAMPLING)]), 6)[0]
    c = chooser([params(**EVERYTHING), params(**SAMPLING)])
    first = generate(c, 3)[1]
    c = c.filter([1])
    assert c.seeds == [1234] and c.do_sample == [True]
    other = chooser([params(), params(do_sample=True, seed=8)])
    generate(other, 1)  # concatenate only joins batches that already ran a step
    merged = HeterogeneousNextTokenChooser.concatenate([other, c])
    assert merged.seeds == [0, 8, 1234] and merged.do_sample == [False, True, True]
    ids = torch.tensor([5, 5, first[-1]])
    rest = []
    for step in range(3, 6):
        ids, _, _ = merged(ids, logits(1, step).expand(3, V))
        rest.append(ids[2].item())
    assert first + rest == reference


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.1]])
    c = HeterogeneousNextTokenChooser.from_pb([params(do_sample=True, seed=0)], [[0]], 4, CPU)
    draws = [c(last(1), probs.log())[0].item() for _ in range(4000)]
    frequencies = torch.bincount(torch.tensor(draws), minlength=4) / len(draws)
    assert torch.allclose(frequencies, probs[0], atol=0.03)


def test_heterogeneous_rows_do_not_affect_each_other() -> None:
    rows = [params(), params(**EVERYTHING), params(repetition_penalty=2.0), params(top_p=0.5, seed=3)]
    c = chooser(rows, [[1, 2, 3], [4, 5], [7, 8, 9], [1]])
    scores = logits(4)
    batched = c.process(last(4), scores)
    for i, row in enumerate(rows):
        alone = chooser([row], [[[1, 2, 3], [4, 5], [7, 8, 9], [1]][i]])
        single = alone.process(last(1), scores[i : i + 1])
        assert torch.allclose(batched[i], single[0], equal_nan=True), i
    assert torch.equal(batched[0], scores[0])


def test_repetition_penalty_sees_prompt_and_generated_tokens() -> None:
    scores = torch.zeros(1, V)
    scores[0, 10] = 5.0  # token 10 wins until penalised; token 11 is the runner-up
    scores[0, 11] = 4.0
    c = chooser([params(repetition_penalty=2.0)], [[10]])
    assert c.process(last(1), scores)[0, 10] == 2.5
    ids, _, _ = c(last(1), scores)
    assert ids.item() == 11  # prompt token 10 was penalised to 2.5
    processed = c.process(ids, scores)
    assert processed[0, 10] == 2.5 and processed[0, 11] == 2.0
    ids, _, _ = c(ids, scores)
    assert ids.item() == 10  # now 11 is seen too: 4.0 / 2 = 2.0 < 2.5


def test_frequency_penalty_grows_with_repetition() -> None:
    scores = torch.zeros(1, V)
    scores[0, 10] = 1.0
    c = chooser([params(frequency_penalty=2.0)], [[10, 10, 1, 2]])
    processed = c.process(last(1), scores)
    # 10 is half the history: 1.0 - 2.0 * 2/4 = 0, now level with the unseen tokens
    assert torch.isclose(processed[0, 10], processed[0, 20])
    assert processed[0, 1] < processed[0, 20]


def test_watermark_row_favours_the_green_list_of_its_previous_token() -> None:
    c = chooser([params(watermark=True), params()])
    scores = torch.zeros(2, V)
    probs = c.process(torch.tensor([9, 9]), scores).softmax(-1)
    green = Watermark(CPU).green_list(9, V)
    assert probs[0, green].sum() > 0.85
    assert torch.equal(probs[1], scores[1].softmax(-1))


def test_filter_keeps_rows_in_order_and_drops_unneeded_history() -> None:
    c = chooser([params(repetition_penalty=1.5), params(seed=4), params(temperature=2.0, seed=5)])
    assert c.history is not None
    kept = c.filter([2, 1])
    assert kept.seeds == [5, 4] and kept.do_sample == [True, False] and kept.history is None
    assert c.filter([0, 1, 2]) is c


def test_concatenate_gives_zero_history_to_rows_without_penalty() -> None:
    a = chooser([params()])
    b = chooser([params(repetition_penalty=1.5)], [[4, 4]])
    merged = HeterogeneousNextTokenChooser.concatenate([a, b])
    assert merged.history is not None
    assert merged.history[0].sum() == 0 and merged.history[1, 4] == 2


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=math.nan), "top_p"),
        (dict(typical_p=0.0), "typical_p"),
        (dict(typical_p=1.01), "typical_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=math.nan), "repetition_penalty"),
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(frequency_penalty=math.nan), "frequency_penalty"),
    ],
)
def test_invalid_parameters_raise_naming_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"`{field}`"):
        chooser([params(), params(**overrides)])


def test_default_proto_zero_temperature_is_rejected() -> None:
    with pytest.raises(ValueError, match="`temperature` must be strictly positive"):
        chooser([generate_pb2.NextTokenChooserParameters()])


def test_prompt_ids_outside_the_vocabulary_are_rejected_when_a_penalty_needs_them() -> None:
    with pytest.raises(ValueError, match="prompt token ids"):
        chooser([params(repetition_penalty=1.2)], [[1, V]])


def test_logits_of_another_width_are_rejected() -> None:
    with pytest.raises(ValueError, match="columns"):
        chooser([params()])(last(1), torch.zeros(1, V + 1))


def test_top_tokens_best_first_and_per_row_n() -> None:
    logprobs = torch.tensor([[-3.0, -1.0, -2.0, -0.5], [-0.1, -5.0, -4.0, -3.0], [-1.0, -1.0, -1.0, -1.0]])
    ids, values = batch_top_tokens([2, 1, 0], logprobs)
    assert ids == [[3, 1], [0], []]
    assert values == [[-0.5, -1.0], [pytest.approx(-0.1)], []]


def test_top_tokens_return_every_tie_at_the_nth_place() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -2.0, -2.0, -3.0], [-1.0, -2.0, -3.0, -4.0, -5.0]])
    ids, values = batch_top_tokens([2, 2], logprobs)
    assert ids[0][0] == 0 and sorted(ids[0][1:]) == [1, 2, 3] and values[0] == [-1.0, -2.0, -2.0, -2.0]
    assert ids[1] == [0, 1]


def test_top_tokens_clamp_n_to_vocab_and_skip_masked_tokens() -> None:
    logprobs = torch.tensor([[-1.0, float("-inf"), -2.0]])
    ids, values = batch_top_tokens([10], logprobs)
    assert ids == [[0, 2]] and values == [[-1.0, -2.0]]
    assert batch_top_tokens([0, 0], logprobs.repeat(2, 1)) == ([[], []], [[], []])
