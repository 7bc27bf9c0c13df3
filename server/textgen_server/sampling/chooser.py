"""Next-token choice for a whole batch, and the top-n tokens reported beside each choice.

Contract with the batch (models/causal_lm.py):

- `HeterogeneousNextTokenChooser.from_pb(params, prompt_ids, vocab_size, device, grammars)`: one row per
  request, each with its own NextTokenChooserParameters. `prompt_ids` seed the penalty history; `vocab_size`
  must be the last dimension of the logits the chooser will see; `grammars` holds the matchers of the rows
  whose grammar the batch compiled (grammar.py), None when no row has one. Invalid values raise
  ValueError naming the field; the servicer turns that into INVALID_ARGUMENT.
- `chooser(last_ids [B] long, scores [B, V] logits of the last position) -> Choice(next_ids [B] long,
  logprobs [B] float32, scores [B, V])`. logprobs[i] is the chosen token's entry of log_softmax of row i's
  *processed* scores (after penalties and warpers), which is what TGI reports; `Choice.scores` are those
  processed scores (what `process` returns: the caller's tensor itself where no processor applies), so a caller
  that reports top-n tokens from the same distribution (TGI's FlashCausalLM) needs no second pass. The chosen
  ids are recorded in the chooser's own history, so the caller never passes the history back, and each grammar
  row's matcher consumes its chosen id. The caller's `scores` tensor is not modified.
- `.filter(indices)` keeps the given rows in that order; `concatenate(choosers)` stacks them.
- `.do_sample[i]` is True when row i samples (its do_sample, or any warper set: TGI's rule); `.seeds[i]` is
  the row's seed, reported in GeneratedText only for sampling rows.
- `choose(chooser, last_ids, logits, top_n_tokens, processed_top_n=...) -> Chosen`: a step of either engine,
  the chooser's call with its ids and logprobs as host lists (one sync) and each row's top-n tokens
  (`batch_top_tokens`); models/generations.py turns a `Chosen` into the Generation messages.

Processing order (TGI's): watermark -> repetition penalty -> frequency penalty -> grammar mask -> temperature ->
top-k -> top-p -> typical-p -> choice. A processor exists only if some row needs it and sees only those rows.
Sampling rows draw from their own seeded generator (see `_sample`); the others take the argmax. A batch of
greedy rows only takes its ids and logprobs from `textgen::greedy_pick` (greedy.py, layers/token_ops.cpp) where the
CPU ops are built for the vector path torch itself takes: torch's ids and log_softmax bits without the [B, V] matrix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from textgen_pb import generate_pb2
from textgen_server.sampling.grammar import RowGrammars
from textgen_server.sampling.greedy import greedy_pick, greedy_pick_for
from textgen_server.sampling.logits_process import (
    FrequencyPenalty,
    RepetitionPenalty,
    Temperature,
    TopK,
    TopP,
    TypicalP,
)
from textgen_server.sampling.watermark import Watermark

# Columns of the per-row parameter table; filter and concatenate then move every parameter in one op.
TEMPERATURE, TOP_K, TOP_P, TYPICAL_P, REPETITION, FREQUENCY, WATERMARK = range(7)


def validate_parameters(p: generate_pb2.NextTokenChooserParameters) -> None:
    """Raise ValueError naming the first invalid field (NaN fails every check)."""
    if not p.temperature > 0:
        raise ValueError(f"`temperature` must be strictly positive, got {p.temperature}")
    if p.top_k < 0:
        raise ValueError(f"`top_k` must be >= 0 (0 disables it), got {p.top_k}")
    if not 0 < p.top_p <= 1:
        raise ValueError(f"`top_p` must be > 0.0 and <= 1.0, got {p.top_p}")
    if not 0 < p.typical_p <= 1:
        raise ValueError(f"`typical_p` must be > 0.0 and <= 1.0, got {p.typical_p}")
    if not p.repetition_penalty > 0:
        raise ValueError(f"`repetition_penalty` must be strictly positive, got {p.repetition_penalty}")
    if not -2 <= p.frequency_penalty <= 2:
        raise ValueError(f"`frequency_penalty` must be >= -2.0 and <= 2.0, got {p.frequency_penalty}")


def _samples(p: generate_pb2.NextTokenChooserParameters) -> bool:
    """TGI's rule: a row samples if asked to or if any warper would change its distribution."""
    warped = p.temperature != 1.0 or p.top_k != 0 or p.top_p < 1.0 or p.typical_p < 1.0
    return p.do_sample or warped


def _generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


# A processor's constructor: its parameter column for the rows it applies to -> the processor.
Maker = Callable[[Tensor], Callable[..., Tensor]]


class _Stage(NamedTuple):
    """A processor and the rows it applies to (None: every row, which spares an index_select)."""

    rows: Tensor | None
    process: Callable[..., Tensor]


def _rows_where(mask: Tensor) -> Tensor | None:
    return None if bool(mask.all()) else mask.nonzero().flatten()


def _take(tensor: Tensor, rows: Tensor | None) -> Tensor:
    return tensor if rows is None else tensor.index_select(0, rows)


def _put(scores: Tensor, rows: Tensor | None, processed: Tensor) -> Tensor:
    return processed if rows is None else scores.index_copy_(0, rows, processed)


class Choice(NamedTuple):
    """One step's choice for every row: the token, its logprob, and the processed scores it was chosen from."""

    next_ids: Tensor  # [B] int64
    logprobs: Tensor  # [B] float32
    scores: Tensor  # [B, V]: the caller's logits where no processor applies, else float32 processed copies


class HeterogeneousNextTokenChooser:
    """Token choice for every row of a batch, each row with its own sampling parameters."""

    def __init__(
        self,
        table: Tensor,
        do_sample: list[bool],
        seeds: list[int],
        generators: list[torch.Generator | None],
        history: Tensor | None,
        vocab_size: int,
        device: torch.device,
        grammars: RowGrammars | None = None,
    ) -> None:
        self.table = table  # [B, 7] float32, columns named above
        self.do_sample = do_sample
        self.seeds = seeds
        self.generators = generators  # one per sampling row, None for greedy rows
        self.history = history  # [B, V] token counts of prompt + generated, only if a row has a penalty
        self.vocab_size = vocab_size
        self.device = device
        self.grammars = grammars  # the rows' grammar matchers, None when no row is constrained
        self._build()

    @classmethod
    def from_pb(
        cls,
        params: list[generate_pb2.NextTokenChooserParameters],
        prompt_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
        grammars: RowGrammars | None = None,
    ) -> HeterogeneousNextTokenChooser:
        """Build the chooser for a new batch; raises ValueError on an invalid parameter."""
        if len(params) != len(prompt_ids):
            raise ValueError(f"{len(params)} parameter sets for {len(prompt_ids)} prompts")
        for p in params:
            validate_parameters(p)
        table = torch.tensor(
            [
                [
                    p.temperature,
                    min(p.top_k, vocab_size),
                    p.top_p,
                    p.typical_p,
                    p.repetition_penalty,
                    p.frequency_penalty,
                    float(p.watermark),
                ]
                for p in params
            ],
            dtype=torch.float32,
            device=device,
        ).reshape(len(params), 7)
        do_sample = [_samples(p) for p in params]
        seeds = [p.seed for p in params]
        generators = [_generator(s, device) if d else None for s, d in zip(seeds, do_sample, strict=True)]
        history = None
        if _needs_history(table):
            if any(not 0 <= token < vocab_size for ids in prompt_ids for token in ids):
                raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
            history = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=device)
            flat = [row * vocab_size + token for row, ids in enumerate(prompt_ids) for token in ids]
            flat_index = torch.tensor(flat, dtype=torch.long, device=device)
            history.view(-1).index_add_(0, flat_index, torch.ones(len(flat), device=device))
        return cls(table, do_sample, seeds, generators, history, vocab_size, device, grammars)

    def _build(self) -> None:
        """Create each processor only if some row needs it, restricted to those rows."""
        t = self.table
        self._watermark: _Stage | None = None
        self._penalties: list[_Stage] = []
        self._warpers: list[_Stage] = []
        self._sampling_rows = [i for i, sample in enumerate(self.do_sample) if sample]
        self._sampling_index = _rows_where(torch.tensor(self.do_sample, dtype=torch.bool, device=self.device))
        self._writes_rows = False
        self._processes = False  # whether any processor exists
        if len(self) == 0:
            return
        if bool(t[:, WATERMARK].any()):
            rows = _rows_where(t[:, WATERMARK] > 0)
            self._watermark = _Stage(rows, Watermark(self.device))
        penalties: list[tuple[int, Tensor, Maker]] = [
            (REPETITION, t[:, REPETITION] != 1.0, RepetitionPenalty),
            (FREQUENCY, t[:, FREQUENCY] != 0.0, FrequencyPenalty),
        ]
        warpers: list[tuple[int, Tensor, Maker]] = [
            (TEMPERATURE, t[:, TEMPERATURE] != 1.0, Temperature),
            (TOP_K, t[:, TOP_K] != 0, lambda k: TopK(k, self.vocab_size)),
            (TOP_P, t[:, TOP_P] < 1.0, TopP),
            (TYPICAL_P, t[:, TYPICAL_P] < 1.0, TypicalP),
        ]
        for built, wanted in ((self._penalties, penalties), (self._warpers, warpers)):
            for column, mask, make in wanted:
                if bool(mask.any()):
                    rows = _rows_where(mask)
                    built.append(_Stage(rows, make(_take(t[:, column], rows))))
        row_sets = [stage.rows for stage in (self._watermark, *self._penalties, *self._warpers) if stage is not None]
        if self.grammars is not None:
            row_sets.append(self.grammars.rows)
        self._processes = bool(row_sets)
        self._writes_rows = any(rows is not None for rows in row_sets)

    def __len__(self) -> int:
        return len(self.seeds)

    def __call__(self, last_ids: Tensor, scores: Tensor) -> Choice:
        """Choose one token per row; see the module docstring for the contract."""
        scores = self.process(last_ids, scores)
        if self._greedy_op(scores):
            next_ids, logprobs = greedy_pick(scores)
        else:
            scores = scores.float()
            # max's indices are argmax's (first maximum; NaN counts as one) from a faster CPU kernel.
            if not self._sampling_rows:
                next_ids = scores.max(dim=-1).indices
            else:
                # softmax, not log_softmax().exp(): exp of the -inf/very negative entries is slow on CPU
                # (benchmark/README.md).
                drawn = self._sample(_take(scores, self._sampling_index).softmax(dim=-1))
                index = self._sampling_index
                next_ids = drawn if index is None else scores.max(dim=-1).indices.index_copy_(0, index, drawn)
            logprobs = torch.log_softmax(scores, dim=-1).gather(1, next_ids.unsqueeze(1)).squeeze(1)
        if self.history is not None:
            self.history[torch.arange(len(self), device=self.device), next_ids] += 1
        if self.grammars is not None:
            self.grammars.advance(_take(next_ids, self.grammars.rows))
        return Choice(next_ids, logprobs, scores)

    def process(self, last_ids: Tensor, scores: Tensor) -> Tensor:
        """The scores [B, V] the choice is made from: `scores` after every processor of its rows, in float32
        (a float32 copy where a processor writes); the caller's tensor itself, any dtype, where none applies.
        Nothing is recorded: the history and the grammar matchers move on in `__call__` only."""
        if scores.shape[-1] != self.vocab_size:
            raise ValueError(f"logits have {scores.shape[-1]} columns, chooser expects {self.vocab_size}")
        if not self._processes:
            return scores
        scores = scores.float()  # for the processors' math; float32 logits stay the caller's tensor
        if self._writes_rows:
            scores = scores.clone()  # stages on a subset of rows write back in place, never into the caller's
        if self._watermark is not None:
            rows, watermark = self._watermark
            scores = _put(scores, rows, watermark(_take(scores, rows), _take(last_ids, rows)))
        for rows, penalty in self._penalties:
            assert self.history is not None  # created whenever a penalty exists
            scores = _put(scores, rows, penalty(_take(scores, rows), _take(self.history, rows)))
        grammars = self.grammars
        if grammars is not None:
            scores = _put(scores, grammars.rows, grammars.mask(_take(scores, grammars.rows)))
        for rows, warper in self._warpers:
            scores = _put(scores, rows, warper(_take(scores, rows)))
        return scores

    def _greedy_op(self, scores: Tensor) -> bool:
        """Whether this step's choice goes to `textgen::greedy_pick`: every row greedy, logits the op reads."""
        return not self._sampling_rows and greedy_pick_for(scores.dtype, scores.device)

    def _sample(self, probs: Tensor) -> Tensor:
        """One draw per sampling row from `probs` [S, V], by inverting its cumulative distribution.

        Each row's draw uses one uniform from its own generator and that row's probabilities only, so a seed
        yields the same tokens whether the request runs alone or in any batch. (TGI divides by Exp(1) noise
        over the whole vocabulary instead, which draws V random numbers per row: far more costly on CPU, see
        benchmark/README.md.)
        """
        uniforms = torch.cat(
            [torch.rand(1, generator=self.generators[row], device=self.device) for row in self._sampling_rows]
        )
        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1:].contiguous()
        picked = torch.searchsorted(cdf, uniforms.unsqueeze(1) * total, right=True)
        # Rounding may land u * total on the plateau after the last token with mass: never pick past it.
        last_with_mass = torch.searchsorted(cdf, total)
        return torch.minimum(picked, last_with_mass).squeeze(1)

    def filter(self, indices: list[int]) -> HeterogeneousNextTokenChooser:
        """A chooser for the rows `indices` (in that order), sharing their generators and history."""
        if indices == list(range(len(self))):
            return self
        index = torch.tensor(indices, dtype=torch.long, device=self.device)
        table = self.table.index_select(0, index)
        history = None
        if self.history is not None and _needs_history(table):
            history = self.history.index_select(0, index)
        return HeterogeneousNextTokenChooser(
            table,
            [self.do_sample[i] for i in indices],
            [self.seeds[i] for i in indices],
            [self.generators[i] for i in indices],
            history,
            self.vocab_size,
            self.device,
            self.grammars.filter(indices) if self.grammars is not None else None,
        )

    @classmethod
    def concatenate(cls, choosers: list[HeterogeneousNextTokenChooser]) -> HeterogeneousNextTokenChooser:
        """One chooser for the rows of every chooser, in order; all must share vocab size and device."""
        first = choosers[0]
        if any(c.vocab_size != first.vocab_size for c in choosers):
            raise ValueError("cannot concatenate choosers with different vocabulary sizes")
        table = torch.cat([c.table for c in choosers])
        history = None
        if _needs_history(table):
            # Rows from a chooser without history have no penalty, so zero counts leave them unchanged.
            history = torch.cat(
                [
                    c.history if c.history is not None else torch.zeros(len(c), first.vocab_size, device=first.device)
                    for c in choosers
                ]
            )
        return cls(
            table,
            [d for c in choosers for d in c.do_sample],
            [s for c in choosers for s in c.seeds],
            [g for c in choosers for g in c.generators],
            history,
            first.vocab_size,
            first.device,
            RowGrammars.concatenate([(c.grammars, len(c)) for c in choosers], first.device),
        )


def _needs_history(table: Tensor) -> bool:
    return bool(((table[:, REPETITION] != 1.0) | (table[:, FREQUENCY] != 0.0)).any())


def batch_top_tokens(top_n_tokens: list[int], logprobs: Tensor) -> tuple[list[list[int]], list[list[float]]]:
    """The best tokens of each row: (ids, logprobs), best first.

    Row i gets every token whose logprob is >= its n-th best, n = min(top_n_tokens[i], V), so ties at the
    n-th place can return more than n; masked (-inf) tokens are never returned. Rows asking for 0 get [].
    """
    vocab_size = logprobs.shape[-1]
    wanted = [min(n, vocab_size) for n in top_n_tokens]
    max_n = max(wanted, default=0)
    if max_n == 0:
        return [[] for _ in wanted], [[] for _ in wanted]
    # One more than the largest n shows whether a tie at the n-th place runs past what topk returned.
    width = min(max_n + 1, vocab_size)
    top = torch.topk(logprobs, width, dim=-1)
    nth_index = torch.tensor([max(n, 1) - 1 for n in wanted], device=logprobs.device).unsqueeze(1)
    nth = top.values.gather(-1, nth_index)
    # -inf is lifted to the most negative float so that masked tokens never count as ties.
    nth = nth.clamp(min=torch.finfo(logprobs.dtype).min)
    wants_none = torch.tensor([n == 0 for n in wanted], device=logprobs.device).unsqueeze(1)
    nth = nth.masked_fill(wants_none, math.inf)
    counts = (top.values >= nth).sum(dim=-1)
    if width < vocab_size and bool((counts == width).any()):
        counts = (logprobs >= nth).sum(dim=-1)
        top = torch.topk(logprobs, int(counts.max()), dim=-1)
    ids, values = top.indices.tolist(), top.values.tolist()
    kept = counts.tolist()
    return [row[:k] for row, k in zip(ids, kept, strict=True)], [row[:k] for row, k in zip(values, kept, strict=True)]


@dataclass
class Chosen:
    """The tokens a step chose, k-th entry for the k-th emitting row: its one token, or with speculation its
    accepted guesses and the token chosen after them, in order; `prompt_logprobs` by row."""

    next_ids: torch.Tensor  # int64 [N]: each emitting row's first token, on the model's device
    ids: list[list[int]]
    logprobs: list[list[float]]
    # Per row, per token: the top-n alternatives; empty when no row asked for top-n tokens.
    top_ids: list[list[list[int]]] = field(default_factory=list)
    top_logprobs: list[list[list[float]]] = field(default_factory=list)
    prompt_logprobs: dict[int, list[float]] = field(default_factory=dict)

    def extend(self, rows: list[int], more: Chosen) -> None:
        """Append the tokens `more` chose for a later position of some rows: its j-th row is this one's
        `rows[j]`-th."""
        for j, k in enumerate(rows):
            self.ids[k] += more.ids[j]
            self.logprobs[k] += more.logprobs[j]
            if more.top_ids:
                if not self.top_ids:
                    self.top_ids, self.top_logprobs = [[] for _ in self.ids], [[] for _ in self.ids]
                self.top_ids[k] += more.top_ids[j]
                self.top_logprobs[k] += more.top_logprobs[j]


def choose(
    chooser: HeterogeneousNextTokenChooser,
    last_ids: torch.Tensor,
    logits: torch.Tensor,
    top_n_tokens: list[int],
    *,
    processed_top_n: bool,
) -> Chosen:
    """One token per row of `logits` [B, V] (the rows' last positions), with its logprob and the top-n tokens;
    one host sync for the ids and logprobs.

    The top-n tokens come from the log_softmax of the scores the chooser chose from (after penalties, grammar,
    watermark and warpers) when `processed_top_n`, as TGI's FlashCausalLM reports them, so a chosen token has
    the same logprob in both lists; else from the raw logits, as TGI's CausalLM reports them.
    """
    choice = chooser(last_ids, logits)
    # float64 holds every id exactly
    ids, values = torch.stack([choice.next_ids.double(), choice.logprobs.double()]).tolist()
    result = Chosen(choice.next_ids, [[int(i)] for i in ids], [[v] for v in values])
    if any(top_n_tokens):
        scores = choice.scores if processed_top_n else logits
        top_ids, top_logprobs = batch_top_tokens(top_n_tokens, torch.log_softmax(scores.float(), -1))
        result.top_ids, result.top_logprobs = [[t] for t in top_ids], [[t] for t in top_logprobs]
    return result
