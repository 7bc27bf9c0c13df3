"""From the tokens a step chose to the Generation messages the router receives: one place for both engines.

The padded CausalLM and the paged engine keep their rows differently but the same per-row token state
(`TokenRows`). After a forward each engine chooses tokens for the rows that emit one this step (`Chosen`, by
sampling/chooser.py's `choose`); `emit_generations` appends them, detokenizes incrementally, applies the stopping
criteria and builds this rank's Generations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from textgen_pb import generate_pb2
from textgen_server.models.model import Model
from textgen_server.sampling.chooser import Chosen, HeterogeneousNextTokenChooser
from textgen_server.sampling.stopping import StoppingCriteria


class TokenRows(Protocol):
    """The per-row token state both batch types hold, row i of each list belonging to `requests[i]`."""

    requests: list[generate_pb2.Request]
    all_input_ids: list[list[int]]  # prompt + generated ids
    prefix_offsets: list[int]
    read_offsets: list[int]
    stopping_criterias: list[StoppingCriteria]
    top_n_tokens: list[int]
    next_token_chooser: HeterogeneousNextTokenChooser


def prompt_logprobs(logits: torch.Tensor, targets: list[int]) -> list[float]:
    """log_softmax(logits[j])[targets[j]] for each j: the logprob each position gave the token after it."""
    if not targets:
        return []
    rows = logits[: len(targets)].float().log_softmax(-1)
    index = torch.tensor(targets, dtype=torch.long, device=rows.device).unsqueeze(1)
    return [float(x) for x in rows.gather(1, index).squeeze(1).tolist()]


def emit_generations(
    model: Model, batch: TokenRows, rows: Sequence[int], chosen: Chosen, by_request_id: bool = False
) -> tuple[list[generate_pb2.Generation], list[bool]]:
    """Record `chosen` for `rows` of `batch`, each row's tokens in order up to the first that stops it (so one
    Generation may carry several tokens); returns this rank's Generations and, per row of `rows`, whether the
    request stopped. A rank reports row i when `i % world_size == rank` (TGI's CausalLM), or with
    `by_request_id` when `request.id % world_size == rank` (TGI's FlashCausalLM, whose rows move)."""
    generations: list[generate_pb2.Generation] = []
    stopped: list[bool] = []
    special = model.all_special_ids
    rank, world_size = model.config.rank, model.config.world_size
    for k, i in enumerate(rows):
        request = batch.requests[i]
        ids = batch.all_input_ids[i]
        criteria = batch.stopping_criterias[i]
        texts: list[str] = []
        stop, reason = False, None
        for next_id in chosen.ids[k]:  # the tokens after a stop are dropped
            ids.append(next_id)
            text, batch.prefix_offsets[i], batch.read_offsets[i] = model.decode_token(
                ids, batch.prefix_offsets[i], batch.read_offsets[i]
            )
            texts.append(text)
            stop, reason = criteria(next_id, text)
            if stop:
                break
        stopped.append(stop)
        if (request.id if by_request_id else i) % world_size != rank:
            continue  # another rank reports this row; the router concatenates all ranks' lists
        emitted = chosen.ids[k][: len(texts)]
        generation = generate_pb2.Generation(
            request_id=request.id,
            tokens=generate_pb2.Tokens(
                ids=emitted,
                logprobs=chosen.logprobs[k][: len(texts)],
                texts=texts,
                is_special=[t in special for t in emitted],
            ),
        )
        if stop:
            generation.generated_text.CopyFrom(_generated_text(model, batch, i, criteria, reason))
        if request.prefill_logprobs and i in chosen.prompt_logprobs:
            prompt = ids[: len(chosen.prompt_logprobs[i]) + 1]
            generation.prefill_tokens.CopyFrom(_tokens(model, prompt, [math.nan, *chosen.prompt_logprobs[i]]))
        if batch.top_n_tokens[i]:
            for t in range(len(texts)):
                generation.top_tokens.append(_tokens(model, chosen.top_ids[k][t], chosen.top_logprobs[k][t]))
        generations.append(generation)
    return generations, stopped


def _tokens(model: Model, ids: list[int], logprobs: list[float]) -> generate_pb2.Tokens:
    """Prompt tokens or top-n alternatives: each id decoded on its own, with its logprob."""
    return generate_pb2.Tokens(
        ids=ids,
        logprobs=logprobs,
        texts=model.tokenizer.batch_decode([[t] for t in ids]),
        is_special=[t in model.all_special_ids for t in ids],
    )


def _generated_text(
    model: Model, batch: TokenRows, i: int, criteria: StoppingCriteria, reason: generate_pb2.FinishReason | None
) -> generate_pb2.GeneratedText:
    """The whole generated text, decoded with one token of left context so a leading space survives."""
    ids = batch.all_input_ids[i]
    read = len(ids) - criteria.current_tokens
    prefix = max(read - 1, 0)
    context = model.decode(ids[prefix:read], skip_special_tokens=True)
    full = model.decode(ids[prefix:], skip_special_tokens=True)
    generated = generate_pb2.GeneratedText(
        text=full[len(context) :],
        generated_tokens=criteria.current_tokens,
        finish_reason=reason if reason is not None else generate_pb2.FINISH_REASON_LENGTH,
    )
    if batch.next_token_chooser.do_sample[i]:
        generated.seed = batch.next_token_chooser.seeds[i]
    return generated
