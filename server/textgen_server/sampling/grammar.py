"""Grammar-constrained generation: one llguidance matcher per constrained row of a batch.

Contract with the router (generate.v3): a row is constrained when `NextTokenChooserParameters.grammar` is not
empty; `grammar_type` says what it holds: GRAMMAR_TYPE_JSON a JSON Schema document (JSON text),
GRAMMAR_TYPE_REGEX a regular expression the whole generated text must match.

Contract with the batch (models/causal_lm.py) and the chooser (chooser.py):

- `GrammarCompiler(tokenizer, eos_token_ids)`, one per model, built on the first constrained request.
  `.compile(params)` returns a fresh matcher for the row, or raises ValueError with the reason the grammar
  cannot be enforced (a schema keyword llguidance cannot enforce is refused, never ignored); the batch refuses
  that request only.
- `RowGrammars.of(matchers, compiler, device)`: the batch's matchers, one per row (None for a free row); None
  when no row is constrained, so free batches carry nothing and do no grammar work at all.
- Each step, for the constrained rows only (`.rows`: their indices, None when every row is constrained):
  `.mask(scores)` puts -inf on every token the row's grammar forbids now ([C, V] in, out of place; columns past
  the tokenizer's vocabulary, a padded embedding's, are always forbidden), then `.advance(ids)` makes each
  matcher consume its row's chosen token. Once a grammar is complete its matcher allows only EOS, so the row
  ends with finish reason EOS (a row that ignores EOS generates EOS until its length, as under TGI's final
  FSM state).
- `.filter(indices)` and `RowGrammars.concatenate(parts)` follow the batch's rows (matchers are moved, not
  copied: the batch they came from is discarded).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Set
from typing import TYPE_CHECKING

import llguidance
import torch
from llguidance import LLMatcher, LLTokenizer

# The numpy helpers, not llguidance.torch: that module compiles a kernel with torch.compile at import, which
# imports torch's dynamo and inductor (about 4 s of CPU on every shard start, for a kernel textgen never calls).
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par
from torch import Tensor

from textgen_pb import generate_pb2
from textgen_server.tokenizer import FastTokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

    from textgen_server.tokenizer import ShardTokenizer

# Whitespace JSON may have between tokens: at most one space, the pattern TGI's outlines-based grammars use. A
# model is then free to write `{"a": 1}` or `{"a":1}` but cannot spend its token budget on whitespace.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": "[ ]?"}

# Distinct grammars whose compiled matcher is kept for the next request with the same grammar (TGI keeps 32).
CACHED_GRAMMARS = 32

# Bit j of llguidance's mask word w allows token 32 * w + j; read as bytes (little-endian, as on every CPU this
# shard runs on), bit j of byte b allows token 8 * b + j. Row v of this table is which tokens of a byte of value v
# are forbidden, so one gather unpacks a whole mask (faster than testing each int32 word against 32 bits:
# benchmark/README.md, "Grammar rows").
_FORBIDDEN = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1) == 0


class GrammarCompiler:
    """Compiles request grammars into llguidance matchers over one model's tokenizer."""

    def __init__(self, tokenizer: ShardTokenizer, eos_token_ids: Set[int]) -> None:
        backend = (
            tokenizer.backend if isinstance(tokenizer, FastTokenizer) else getattr(tokenizer, "backend_tokenizer", None)
        )
        if backend is None:
            raise ValueError("grammars need a fast (tokenizers) tokenizer, and this model's is not one")
        vocab = len(tokenizer)
        # The model's EOS ids, so that a complete grammar forces a token the stopping criteria stop on.
        eos = sorted(i for i in eos_token_ids if i < vocab) or tokenizer.eos_token_id
        # What llguidance.hf.from_tokenizer does with transformers' fast tokenizer, from its backend (that module
        # imports transformers, which a shard with a kept tokenizer does not: tokenizer.py).
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        self.tokenizer = LLTokenizer(backend.to_str(), eos_token=eos)
        self.vocab_size = self.tokenizer.vocab_size
        self.executor = llguidance.LLExecutor()
        self._compiled: OrderedDict[tuple[int, str], LLMatcher] = OrderedDict()

    def compile(self, params: generate_pb2.NextTokenChooserParameters) -> LLMatcher:
        """A matcher at the start of `params.grammar`; ValueError naming why the grammar cannot be enforced."""
        key = (params.grammar_type, params.grammar)
        template = self._compiled.get(key)
        if template is None:
            template = self._build(params.grammar_type, params.grammar)
            self._compiled[key] = template
            if len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return template.deep_copy()

    def _build(self, grammar_type: int, text: str) -> LLMatcher:
        if grammar_type == generate_pb2.GRAMMAR_TYPE_JSON:
            try:
                grammar = LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
            except ValueError as error:
                raise ValueError(f"`grammar` is not a JSON schema: {error}") from None
        elif grammar_type == generate_pb2.GRAMMAR_TYPE_REGEX:
            grammar = LLMatcher.grammar_from_regex(text)
        else:
            raise ValueError(f"`grammar` is set but `grammar_type` is {grammar_type}, neither JSON nor REGEX")
        # log_level 0: a refused grammar is reported to the request, not printed by the library.
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"`grammar` cannot be enforced: {matcher.get_error()}")
        return matcher


class RowGrammars:
    """The matchers of a batch's rows and the per-step mask of its constrained rows."""

    def __init__(self, matchers: list[LLMatcher | None], compiler: GrammarCompiler, device: torch.device) -> None:
        self.matchers = matchers
        self.compiler = compiler
        self.device = device
        constrained = [i for i, m in enumerate(matchers) if m is not None]
        self._constrained: list[LLMatcher] = [m for m in matchers if m is not None]
        self.rows = (
            None if len(constrained) == len(matchers) else torch.tensor(constrained, dtype=torch.long, device=device)
        )
        # (matcher, its row in the bitmask), the form llguidance's parallel executor takes.
        self._targets = [(m, k) for k, m in enumerate(self._constrained)]
        self._words = allocate_token_bitmask(len(self._constrained), compiler.vocab_size)
        self._bitmask = torch.from_numpy(self._words)  # the same memory

    @classmethod
    def of(
        cls, matchers: list[LLMatcher | None], compiler: GrammarCompiler | None, device: torch.device
    ) -> RowGrammars | None:
        """The grammars of rows `matchers` (logits on `device`), or None when no row has one."""
        if compiler is None or all(m is None for m in matchers):
            return None
        return cls(matchers, compiler, device)

    def mask(self, scores: Tensor) -> Tensor:
        """`scores` [C, V] of the constrained rows with every token their grammar forbids now at -inf."""
        fill_next_token_bitmask_par(self.compiler.executor, self._targets, self._words)
        mask_bytes = self._bitmask.view(torch.uint8).view(-1).int()
        forbidden = _FORBIDDEN.index_select(0, mask_bytes).view(len(self._constrained), -1)
        width = scores.shape[-1]
        known = min(width, self.compiler.vocab_size)
        forbidden = forbidden[:, :known]
        if known < width:
            # Logits wider than the tokenizer (a padded embedding): the extra ids are no text, never allowed.
            forbidden = torch.nn.functional.pad(forbidden, (0, width - known), value=True)
        return scores.masked_fill(forbidden.to(scores.device, non_blocking=True), float("-inf"))

    def advance(self, chosen: Tensor) -> None:
        """Each constrained row's matcher consumes `chosen` [C], that row's new token."""
        # One by one on this thread: a fraction of a millisecond for a whole batch, and it never waits for the
        # executor's threads, which a busy machine can leave descheduled (benchmark/README.md, "Grammar rows").
        for matcher, token in zip(self._constrained, chosen.tolist(), strict=True):
            matcher.consume_token(token)

    def filter(self, indices: list[int]) -> RowGrammars | None:
        return RowGrammars.of([self.matchers[i] for i in indices], self.compiler, self.device)

    @staticmethod
    def concatenate(parts: list[tuple[RowGrammars | None, int]], device: torch.device) -> RowGrammars | None:
        """The grammars of several batches' rows in order; `parts` pairs each batch's grammars with its size."""
        compiler = next((g.compiler for g, _ in parts if g is not None), None)
        matchers = [m for g, size in parts for m in (g.matchers if g is not None else [None] * size)]
        return RowGrammars.of(matchers, compiler, device)
