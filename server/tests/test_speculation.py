"""N-gram speculation on the paged engine (`--speculate N`): a row feeds its guesses after its last token and
emits every guess its own chooser confirms, plus the token after them, in one step.

The oracle is the same engine without speculation (and transformers for greedy rows): a guess may change how
many tokens a step emits, never which, for greedy, seeded, penalised and constrained rows alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from shard_helpers import HFOracle, check_uneven_batch, chooser, make_batch, make_request
from test_paged_lm import Blocks, paged_model, with_blocks

from textgen_pb import generate_pb2 as pb
from textgen_server.builder import CYCLE_PERIOD as PERIOD
from textgen_server.models.paged_batch import PagedBatch
from textgen_server.models.paged_lm import PagedCausalLM
from textgen_server.utils.speculate import NGramIndex

LOOPS = ["a b c d a b c d a b", "def f(x):\n    return x", "one two one two one"]


@pytest.fixture(scope="module")
def speculating(cycling_llama: Path) -> PagedCausalLM:
    return paged_model(cycling_llama, speculate=3)


@pytest.fixture(scope="module")
def plain(cycling_llama: Path) -> PagedCausalLM:
    return paged_model(cycling_llama)


def run(model: PagedCausalLM, requests: list[pb.Request]) -> tuple[dict[int, list[pb.Generation]], int]:
    """Every request to its end, filtering finished rows as the router does; the Generations by request and the
    number of steps taken."""
    out: dict[int, list[pb.Generation]] = {r.id: [] for r in requests}
    batch: PagedBatch | None = PagedBatch.from_pb(make_batch(1, requests), model)
    steps = 0
    while batch is not None:
        generations, batch, _ = model.generate_token(batch)
        steps += 1
        for g in generations:
            out[g.request_id].append(g)
        done = {g.request_id for g in generations if g.HasField("generated_text")}
        if batch is not None and done:
            live = [r.id for r in batch.requests if r.id not in done]
            if not live:
                batch.release()
            batch = batch.filter(live) if live else None
    return out, steps


def flat(generations: list[pb.Generation]) -> tuple[list[int], list[float], list[str], list[list[int]], str]:
    """A request's tokens, logprobs, texts, top-n ids per token and generated text, however the steps split them."""
    ids = [t for g in generations for t in g.tokens.ids]
    logprobs = [x for g in generations for x in g.tokens.logprobs]
    texts = [t for g in generations for t in g.tokens.texts]
    top = [list(top.ids) for g in generations for top in g.top_tokens]
    return ids, logprobs, texts, top, generations[-1].generated_text.text


def same(guessed: list[pb.Generation], alone: list[pb.Generation]) -> bool:
    """The same request's output with and without guesses: equal but for float rounding in the logprobs (a step
    of several tokens per row multiplies matrices of another shape)."""
    ids, logprobs, *rest = flat(guessed)
    ids_alone, logprobs_alone, *rest_alone = flat(alone)
    return ids == ids_alone and rest == rest_alone and logprobs == pytest.approx(logprobs_alone, abs=1e-4)


def test_ngram_index_proposes_what_followed_the_latest_occurrence() -> None:
    index = NGramIndex()
    assert index.propose([5], 3) == []  # nothing before the last token
    # The pair (1, 2) occurred before, at 0-1: what followed it, not what followed the later lone 2.
    assert index.propose([1, 2, 3, 9, 2, 4, 1, 2], 3) == [3, 9, 2]
    index = NGramIndex()
    assert index.propose([7, 1, 8, 2, 1], 2) == [8, 2]  # no earlier (2, 1): the token 1 alone
    assert index.propose([7, 1, 8, 2, 1, 6], 2) == []  # 6 never occurred before
    assert index.propose([7, 1, 8, 2, 1, 6, 1], 5) == [6, 1, 6, 1, 6]  # the latest 1; the loop (6, 1) goes on
    assert index.propose([7, 1, 8, 2, 1, 6, 1, 1], 3) == [1, 1, 1]
    assert index.propose([7, 1, 8, 2, 1, 6, 1, 1], 0) == []


def test_a_row_whose_guess_was_refused_waits_longer_each_time() -> None:
    index, ids = NGramIndex(), [4, 5, 6, 4]
    assert index.propose(ids, 2) == [5, 6]
    waits = []
    for _ in range(6):
        index.record(2, 0)  # refused: the token after 4 was not 5
        waits.append(0)
        while not index.propose(ids, 2):
            waits[-1] += 1
    assert waits == [1, 3, 7, 15, 15, 15]
    index.record(2, 1)  # one confirmed guess ends the wait
    assert index.propose(ids, 2) == [5, 6]
    index.record(0, 0)  # a step without guesses changes nothing
    assert index.propose(ids, 2) == [5, 6]


def test_info_reports_speculate_and_no_chunking(speculating: PagedCausalLM) -> None:
    info = speculating.info
    assert info.speculate == 3 and not info.support_chunking  # TGI: speculation turns chunking off


def test_greedy_tokens_are_transformers_with_fewer_steps(
    speculating: PagedCausalLM, plain: PagedCausalLM, cycling_llama: Path
) -> None:
    oracle = HFOracle(cycling_llama)
    requests = [make_request(i, text, 24) for i, text in enumerate(LOOPS)]
    guessed, steps = run(speculating, requests)
    alone, plain_steps = run(plain, requests)
    for i, text in enumerate(LOOPS):
        tokens = flat(guessed[i])[0]
        assert same(guessed[i], alone[i])
        assert tokens == oracle.greedy(text, 24), f"request {i}"
        assert tokens[PERIOD:] == tokens[:-PERIOD]  # the model loops, as built
    assert plain_steps == 24
    # One token a step until a whole period is out, then the 3 guesses and the token after them.
    assert steps == PERIOD + -(-(24 - PERIOD) // 4)


@pytest.mark.parametrize("looping", [True, False], ids=["cycling", "random"])
def test_bfloat16_tokens_are_the_same_with_guesses(looping: bool, cycling_llama: Path, tiny_llama: Path) -> None:
    model_dir = cycling_llama if looping else tiny_llama
    speculating, plain = (paged_model(model_dir, speculate=n, dtype="bfloat16") for n in (3, 0))
    requests = [make_request(i, text, 24, top_n_tokens=2) for i, text in enumerate(LOOPS)]
    guessed, steps = run(speculating, requests)
    alone, _ = run(plain, requests)
    for request in requests:
        assert flat(guessed[request.id])[0] == flat(alone[request.id])[0], f"request {request.id}"
        assert flat(guessed[request.id])[3] == flat(alone[request.id])[3]
    assert (steps < 24) == looping


@pytest.mark.parametrize("looping", [True, False], ids=["cycling", "random"])
def test_uneven_batch_through_filter_and_concatenate_matches_transformers(
    looping: bool, speculating: PagedCausalLM, cycling_llama: Path, tiny_llama: Path
) -> None:
    """Rows joining and leaving a speculating batch; on the random model nearly every guess is refused."""
    model = speculating if looping else paged_model(tiny_llama, speculate=3)
    check_uneven_batch(model, HFOracle(cycling_llama if looping else tiny_llama))


def test_seeded_penalised_and_top_n_rows_emit_what_they_emit_without_guesses(
    speculating: PagedCausalLM, plain: PagedCausalLM
) -> None:
    """A row's history and generator move on by exactly the tokens it emits, and each token's top-n and logprob
    come from its own position's processed scores."""
    # At temperature 1.5 the cycle's next token has about 0.7 of the mass: sampled rows leave the loop at times,
    # so their guesses are sometimes all confirmed and sometimes refused part-way.
    params = [
        chooser(do_sample=True, temperature=1.5, seed=7),
        chooser(repetition_penalty=1.3, frequency_penalty=0.4),
        chooser(do_sample=True, temperature=1.5, top_k=3, seed=11, repetition_penalty=0.9),
        chooser(do_sample=True, temperature=1.5, seed=12),
        chooser(),
    ]
    requests = [
        make_request(i, LOOPS[i % len(LOOPS)], 40, params=p, top_n_tokens=2 * (i % 2)) for i, p in enumerate(params)
    ]
    guessed, _ = run(speculating, requests)
    alone, _ = run(plain, requests)
    for request in requests:
        assert same(guessed[request.id], alone[request.id]), f"request {request.id}"
    for sampled in (0, 2, 3):
        tokens = flat(guessed[sampled])[0]
        assert tokens[PERIOD:] != tokens[:-PERIOD]  # it left the loop
        assert any(len(g.tokens.ids) > 1 for g in guessed[sampled])


@pytest.mark.parametrize("first, last", [(2, 9), (3, 14)])
def test_a_stop_inside_an_accepted_run_ends_the_request_there(
    speculating: PagedCausalLM, plain: PagedCausalLM, first: int, last: int
) -> None:
    """The stop sequence is the text of tokens first..last, longer than a period: it first ends at token `last`,
    inside a step that emits several tokens (0-4 one a step, then 5-8, 9-12, 13-16)."""
    runs, _ = run(plain, [make_request(i, text, 30) for i, text in enumerate(LOOPS)])
    requests = [
        make_request(i, text, 30, stop=("".join(flat(runs[i])[2][first : last + 1]),)) for i, text in enumerate(LOOPS)
    ]
    guessed, _ = run(speculating, requests)
    alone, _ = run(plain, requests)
    for request in requests:
        assert same(guessed[request.id], alone[request.id])
        ended = guessed[request.id][-1]
        assert ended.generated_text.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
        assert ended.generated_text.generated_tokens == last + 1
        assert len(ended.tokens.ids) < 4  # the step's tokens after the stop were dropped


def test_guesses_never_pass_max_new_tokens_or_the_routers_blocks(speculating: PagedCausalLM) -> None:
    """Blocks as the router gives them (prompt + max_new_tokens - 1 positions, whole blocks): a row guesses no
    more than the tokens it may still emit, so it writes no position past them."""
    blocks = Blocks(speculating.paging.block_size)
    requests = []
    for i, (text, new) in enumerate(zip(LOOPS, [5, 9, 16], strict=True)):
        ids = speculating.tokenizer(text)["input_ids"]
        requests.append(with_blocks(make_request(i, text, new), blocks.take(len(ids) + new - 1)))
    guessed, _ = run(speculating, requests)
    for request in requests:
        tokens = flat(guessed[request.id])[0]
        assert len(tokens) == request.stopping_parameters.max_new_tokens
        assert guessed[request.id][-1].generated_text.finish_reason == pb.FINISH_REASON_LENGTH


def test_rows_on_a_lora_adapter_beside_base_rows(cycling_llama: Path, tmp_path: Path) -> None:
    """Adapter rows (the adapter breaks the loop, so their guesses are mostly refused) and base rows (confirmed)
    in one speculating batch: each row's LoRA delta covers its fed guesses, the tokens are the plain engine's."""
    from textgen_server.builder import build_test_adapter

    spec = f"one={build_test_adapter(tmp_path / 'one', cycling_llama, seed=1)}"
    speculating, plain = (paged_model(cycling_llama, speculate=n, lora_adapters=spec) for n in (3, 0))
    requests = [make_request(i, LOOPS[i % len(LOOPS)], 20) for i in range(4)]
    for request in requests[::2]:
        request.adapter_id = "one"
    guessed, _ = run(speculating, requests)
    alone, _ = run(plain, requests)
    for request in requests:
        assert same(guessed[request.id], alone[request.id]), f"request {request.id}"
    assert any(len(g.tokens.ids) > 1 for g in guessed[1])
    assert flat(guessed[0])[0] != flat(guessed[1])[0][: len(flat(guessed[0])[0])]  # the adapter changed the text


def test_a_grammar_row_guesses_nothing(speculating: PagedCausalLM, plain: PagedCausalLM) -> None:
    constrained = make_request(0, LOOPS[0], 12)
    constrained.parameters.grammar = "(a b )+"
    constrained.parameters.grammar_type = pb.GRAMMAR_TYPE_REGEX
    requests = [constrained, make_request(1, LOOPS[0], 12)]
    guessed, _ = run(speculating, requests)
    alone, _ = run(plain, requests)
    assert same(guessed[0], alone[0]) and same(guessed[1], alone[1])
    assert all(len(g.tokens.ids) == 1 for g in guessed[0])
