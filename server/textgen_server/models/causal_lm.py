"""The padded causal-LM path (TGI's CausalLM): any transformers decoder, batches as padded tensors.

Layout of a batch with B rows after t steps (L = max_input_length, the longest row incl. the token fed now):
  input_ids [B, 1] (prefill: [B, L], left padded), position_ids likewise;
  attention_mask [B, L + padding_right_offset]: live part left padded, then zero columns reserved for the
  tokens still to come (one is switched on per step, so decode never reallocates the mask);
  past KV per layer [B, kv_heads, L - 1, head_dim], right aligned like the mask (the fed token is not in it).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from textgen_pb import generate_pb2
from textgen_server.config import ShardConfig
from textgen_server.models.cache_names import cache_keyword
from textgen_server.models.generations import emit_generations, prompt_logprobs
from textgen_server.models.kv_cache import (
    KVCache,
    concatenate_caches,
    fill_holes_from_tail,
    filter_cache,
    spare_columns,
)
from textgen_server.models.model import Batch, InvalidRequestError, Model, prepare_row, prepare_rows, rows_to_keep
from textgen_server.sampling.chooser import HeterogeneousNextTokenChooser, choose
from textgen_server.sampling.grammar import RowGrammars
from textgen_server.sampling.stopping import StoppingCriteria

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Self

    from llguidance import LLMatcher

    from textgen_server.tokenizer import ShardTokenizer

    Row = tuple[list[int], LLMatcher | None, int]  # prepare_row's: prompt ids, grammar matcher, adapter index


@dataclass
class CausalLMBatch(Batch):
    batch_id: int
    requests: list[generate_pb2.Request]
    requests_idx_mapping: dict[int, int]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    past_key_values: KVCache | None
    all_input_ids: list[list[int]]  # prompt + generated ids of each row, unpadded
    input_lengths: list[int]
    prefix_offsets: list[int]
    read_offsets: list[int]
    next_token_chooser: HeterogeneousNextTokenChooser
    stopping_criterias: list[StoppingCriteria]
    top_n_tokens: list[int]
    max_input_length: int
    padding_right_offset: int
    max_tokens: int
    adapter_indices: list[int]  # each row's LoRA adapter (Model.adapter_index); 0 = the base model

    @classmethod
    def from_pb(cls, pb: generate_pb2.Batch, model: Model) -> CausalLMBatch:
        if not pb.requests:
            raise InvalidRequestError("Batch must have at least one request")
        return cls.from_rows(pb, model, prepare_rows(pb.requests, lambda r: prepare_row(r, model)))

    @classmethod
    def from_rows(cls, pb: generate_pb2.Batch, model: Model, rows: Sequence[Row]) -> Self:
        """The batch of `pb`'s requests from their prepared rows (prompt ids, grammar matcher, adapter index)."""
        # Longest prompts first: rows of similar length stay neighbours, so decode attention can skip the
        # left padding of each group of rows (TPCausalLM's attention groups).
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        requests = [pb.requests[i] for i in order]
        all_input_ids = [rows[i][0] for i in order]
        matchers = [rows[i][1] for i in order]
        device = model.config.device
        constrained = any(m is not None for m in matchers)  # a free batch never builds the compiler
        grammars = RowGrammars.of(matchers, model.grammar_compiler, device) if constrained else None
        chooser = HeterogeneousNextTokenChooser.from_pb(
            [r.parameters for r in requests], all_input_ids, model.config.vocab_size, device, grammars
        )
        stopping = [StoppingCriteria.from_pb(r.stopping_parameters, model.config.eos_token_ids) for r in requests]

        size = len(requests)
        input_lengths = [len(ids) for ids in all_input_ids]
        max_input_length = max(input_lengths)
        padding_right_offset = max(s.max_new_tokens for s in stopping)
        pad_id = model.tokenizer.pad_token_id
        assert pad_id is not None  # the loader gives every tokenizer one (tokenizer.py)
        input_ids = torch.full((size, max_input_length), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((size, max_input_length + padding_right_offset), dtype=torch.long)
        for row, ids in enumerate(all_input_ids):
            input_ids[row, max_input_length - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, max_input_length - len(ids) : max_input_length] = 1
        live_mask = attention_mask[:, :max_input_length]
        position_ids = live_mask.cumsum(-1) - 1
        position_ids.masked_fill_(live_mask == 0, 1)
        return cls(
            batch_id=pb.id,
            requests=requests,
            requests_idx_mapping={r.id: i for i, r in enumerate(requests)},
            input_ids=input_ids.to(model.config.device),
            attention_mask=attention_mask.to(model.config.device),
            position_ids=position_ids.to(model.config.device),
            past_key_values=None,
            all_input_ids=all_input_ids,
            input_lengths=input_lengths,
            prefix_offsets=[max(n - 5, 0) for n in input_lengths],
            read_offsets=input_lengths[:],
            next_token_chooser=chooser,
            stopping_criterias=stopping,
            top_n_tokens=[r.top_n_tokens for r in requests],
            max_input_length=max_input_length,
            padding_right_offset=padding_right_offset,
            max_tokens=size * max_input_length + sum(s.max_new_tokens for s in stopping),
            adapter_indices=[rows[i][2] for i in order],
        )

    def to_pb(self) -> generate_pb2.CachedBatch:
        return generate_pb2.CachedBatch(
            id=self.batch_id,
            request_ids=[r.id for r in self.requests],
            size=len(self),
            max_tokens=self.max_tokens,
            current_tokens=len(self.input_ids),
        )

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(self.input_lengths)

    def release(self) -> None:
        """Nothing to give back: the batch's KV cache is its own."""

    def filter(self, request_ids: list[int]) -> CausalLMBatch:
        """Keep `request_ids` in place: rows, mask columns and KV positions nobody needs any more go."""
        rows = rows_to_keep(request_ids, self.requests_idx_mapping, self.batch_id)
        if len(rows) == len(self):
            return self
        keep = fill_holes_from_tail(rows)
        stopping = [self.stopping_criterias[i] for i in keep]
        input_lengths = [self.input_lengths[i] for i in keep]
        new_max_input_length = max(input_lengths)
        new_padding_right_offset = max(s.max_new_tokens - s.current_tokens for s in stopping)
        index = torch.tensor(keep, dtype=torch.long, device=self.input_ids.device)

        live_end = self.attention_mask.shape[1] - self.padding_right_offset
        self.attention_mask = self.attention_mask[
            index, live_end - new_max_input_length : live_end + new_padding_right_offset
        ]
        self.input_ids = self.input_ids.index_select(0, index)
        self.position_ids = self.position_ids.index_select(0, index)
        if self.past_key_values is not None:
            filter_cache(self.past_key_values, keep, new_max_input_length - 1)

        self.requests = [self.requests[i] for i in keep]
        self.requests_idx_mapping = {r.id: i for i, r in enumerate(self.requests)}
        self.all_input_ids = [self.all_input_ids[i] for i in keep]
        self.input_lengths = input_lengths
        self.prefix_offsets = [self.prefix_offsets[i] for i in keep]
        self.read_offsets = [self.read_offsets[i] for i in keep]
        self.next_token_chooser = self.next_token_chooser.filter(keep)
        self.stopping_criterias = stopping
        self.top_n_tokens = [self.top_n_tokens[i] for i in keep]
        self.adapter_indices = [self.adapter_indices[i] for i in keep]
        self.max_input_length = new_max_input_length
        self.padding_right_offset = new_padding_right_offset
        self.max_tokens = len(keep) * new_max_input_length + sum(s.max_new_tokens - s.current_tokens for s in stopping)
        return self

    @classmethod
    def concatenate(cls, batches: list[Self]) -> Self:
        """Stack batches row-wise, right-aligning every mask and KV cache on the longest row."""
        caches: list[tuple[KVCache, int]] = []
        for b in batches:
            if b.past_key_values is None:
                raise InvalidRequestError("only batches that ran a prefill can be concatenated")
            caches.append((b.past_key_values, b.max_input_length - 1))
        size = sum(len(b) for b in batches)
        max_input_length = max(b.max_input_length for b in batches)
        padding_right_offset = max(b.padding_right_offset for b in batches)
        first = batches[0]
        device = first.input_ids.device
        attention_mask = first.attention_mask.new_zeros((size, max_input_length + padding_right_offset))
        start = 0
        for b in batches:
            left = max_input_length - b.max_input_length
            attention_mask[start : start + len(b), left:max_input_length] = b.attention_mask[:, : b.max_input_length]
            start += len(b)

        cache = concatenate_caches(
            caches,
            max_input_length - 1,
            spare_columns(padding_right_offset),
        )
        requests = [r for b in batches for r in b.requests]
        return cls(
            batch_id=first.batch_id,
            requests=requests,
            requests_idx_mapping={r.id: i for i, r in enumerate(requests)},
            input_ids=torch.cat([b.input_ids for b in batches]).to(device),
            attention_mask=attention_mask,
            position_ids=torch.cat([b.position_ids for b in batches]),
            past_key_values=cache,
            all_input_ids=[ids for b in batches for ids in b.all_input_ids],
            input_lengths=[n for b in batches for n in b.input_lengths],
            prefix_offsets=[o for b in batches for o in b.prefix_offsets],
            read_offsets=[o for b in batches for o in b.read_offsets],
            next_token_chooser=HeterogeneousNextTokenChooser.concatenate([b.next_token_chooser for b in batches]),
            stopping_criterias=[s for b in batches for s in b.stopping_criterias],
            top_n_tokens=[n for b in batches for n in b.top_n_tokens],
            max_input_length=max_input_length,
            padding_right_offset=padding_right_offset,
            max_tokens=sum(b.max_tokens + (max_input_length - b.max_input_length) * len(b) for b in batches),
            adapter_indices=[a for b in batches for a in b.adapter_indices],
        )


class CausalLM(Model[CausalLMBatch]):
    """Runs padded prefill/decode steps on a causal LM module with the transformers forward signature."""

    def __init__(self, module: torch.nn.Module, config: ShardConfig, tokenizer: ShardTokenizer) -> None:
        super().__init__(config, tokenizer)
        self.module = module
        # The LoRA adapters the module loaded (tp_llama.TPCausalLM); a module without any refuses every adapter.
        self.adapters = {name: i for i, name in enumerate(getattr(module, "adapter_names", []), start=1)}
        params = inspect.signature(module.forward).parameters
        # Prefill without prompt logprobs needs only the last position's logits: skip the LM head elsewhere.
        self._has_logits_to_keep = "logits_to_keep" in params
        self._cache_keyword = cache_keyword(module)

    @property
    def batch_type(self) -> type[CausalLMBatch]:
        return CausalLMBatch

    def forward(
        self, batch: CausalLMBatch, all_logits: bool, inputs_embeds: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, KVCache]:
        """Logits [B, S, V] (S = 1 unless `all_logits`) and the grown KV cache; the module reads `inputs_embeds`
        [B, S, H] where given (a VLM's prefill), else the batch's ids."""
        cache = batch.past_key_values if batch.past_key_values is not None else self._new_cache(batch)
        width = batch.attention_mask.shape[1] - batch.padding_right_offset
        kwargs: dict[str, object] = {}
        if self._has_logits_to_keep and not all_logits:
            kwargs["logits_to_keep"] = 1
        if any(batch.adapter_indices):  # only modules that loaded adapters ever see such a row
            kwargs["adapter_indices"] = batch.adapter_indices
        kwargs[self._cache_keyword] = cache
        inputs = {"input_ids": batch.input_ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
        out = self.module(
            **inputs,
            attention_mask=batch.attention_mask[:, :width],
            position_ids=batch.position_ids,
            use_cache=True,
            **kwargs,
        )
        return out.logits, getattr(out, self._cache_keyword)

    def _new_cache(self, batch: CausalLMBatch) -> KVCache:
        """The module's own preallocated cache when it has one (room for the first decode steps), else HF's."""
        new_cache = getattr(self.module, "new_cache", None)
        if new_cache is not None:
            return new_cache(spare_columns(batch.padding_right_offset))
        from transformers import DynamicCache  # the module is transformers' own, which imported it

        return DynamicCache()

    @torch.inference_mode()
    def generate_token(
        self, batch: CausalLMBatch, logits: torch.Tensor | None = None
    ) -> tuple[list[generate_pb2.Generation], CausalLMBatch | None, tuple[int, int]]:
        assert logits is None, "the padded engine does not decode ahead"
        start = time.perf_counter_ns()
        prefill = batch.past_key_values is None
        want_prefill_logprobs = prefill and any(r.prefill_logprobs for r in batch.requests)
        logits, cache = self.forward(batch, all_logits=want_prefill_logprobs)
        chooser, last_ids = batch.next_token_chooser, batch.input_ids[:, -1]
        chosen = choose(chooser, last_ids, logits[:, -1, :], batch.top_n_tokens, processed_top_n=False)
        if want_prefill_logprobs:
            width = logits.shape[1]
            for i, (request, ids) in enumerate(zip(batch.requests, batch.all_input_ids, strict=True)):
                if request.prefill_logprobs:
                    chosen.prompt_logprobs[i] = prompt_logprobs(logits[i, width - len(ids) :], ids[1:])
        forward_ns = time.perf_counter_ns() - start

        decode_start = time.perf_counter_ns()
        generations, stopped = emit_generations(self, batch, range(len(batch)), chosen)
        batch.input_lengths = [n + 1 for n in batch.input_lengths]
        stopped_all = all(stopped)

        if stopped_all:
            return generations, None, (forward_ns, time.perf_counter_ns() - decode_start)

        # Advance in place: the fed column leaves, the chosen ids become the next input.
        batch.input_ids = chosen.next_ids.view(-1, 1)
        batch.attention_mask[:, batch.attention_mask.shape[1] - batch.padding_right_offset] = 1
        batch.padding_right_offset -= 1
        batch.position_ids = batch.position_ids[:, -1:] + 1
        batch.past_key_values = cache
        batch.max_input_length += 1
        return generations, batch, (forward_ns, time.perf_counter_ns() - decode_start)
