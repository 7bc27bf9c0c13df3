"""The paged engine (TGI v3's FlashCausalLM, for CPU first): one forward over every row's new tokens, keys and
values in the shard's KV pool, prefix-cache hits and chunked prefill.

A step: each row feeds its `chunk_lengths[i]` next tokens (the rest of the prompt, a chunk of it, or the last
generated token); the tensor-parallel module writes their keys and values to the row's slots and attends
through its block table (models/tp_llama.py `forward_paged`). Rows whose prompt is now wholly computed choose
a token; rows still prefilling get their next chunk (TGI's rule: the step's prefill budget shared from the
last row back, each at least one token) and emit nothing.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from textgen_pb import generate_pb2
from textgen_server.config import PagingConfig, ShardConfig
from textgen_server.layers.lora import AdapterSegments
from textgen_server.models.generations import Chosen, choose, emit_generations, prompt_logprobs
from textgen_server.models.kv_pool import KVPool, free_memory, pool_blocks
from textgen_server.models.model import Model
from textgen_server.models.paged_batch import PagedBatch
from textgen_server.models.tp_llama import PagedStep
from textgen_server.utils.tokens import HeterogeneousNextTokenChooser

if TYPE_CHECKING:
    from textgen_server.models.tp_llama import TPCausalLM


class PagedCausalLM(Model[PagedBatch]):
    """Runs paged steps of a tensor-parallel module (`TPCausalLM`) over this shard's KV pool."""

    def __init__(
        self, module: TPCausalLM, config: ShardConfig, tokenizer: PreTrainedTokenizerBase, paging: PagingConfig
    ) -> None:
        super().__init__(config, tokenizer)
        self.module = module
        self.paging = paging
        self.adapters = {name: i for i, name in enumerate(module.adapter_names, start=1)}
        self.max_prefill_tokens: int | None = None  # the step's token budget, from Warmup (chunk sizes)
        self._pool: KVPool | None = None

    @property
    def batch_type(self) -> type[PagedBatch]:
        return PagedBatch

    @property
    def pool(self) -> KVPool:
        """The KV pool, sized from the free memory when first needed (Warmup, or the first batch)."""
        if self._pool is None:
            shape = self.module.pool_shape(self.paging.block_size)
            blocks = pool_blocks(shape, free_memory(self.config.device, self.config.world_size))
            self._pool = KVPool(shape, blocks, self.config.device)
        return self._pool

    @property
    def support_chunking(self) -> bool:
        return self.paging.chunking

    @property
    def info(self) -> generate_pb2.InfoResponse:
        info = super().info
        info.requires_padding = False
        # Keys and values depend on the adapter, but the router's prefix cache keys on tokens only.
        info.use_prefix_caching = self.paging.prefix_caching and not self.adapters
        info.attention_impl = self.paging.attention
        info.block_size = self.paging.block_size
        return info

    def warmup(
        self,
        batch: PagedBatch,
        max_input_tokens: int | None,
        max_total_tokens: int | None,
        max_prefill_tokens: int | None = None,
    ) -> tuple[int | None, int, int]:
        """Run the warmup batch once and report the pool's capacity (max_supported_total_tokens).

        Unset limits default as in TGI: with chunking a request may fill the pool up to the model's context;
        without, max_total is the warmup batch's tokens. max_input = max_total - 1.
        """
        self.max_prefill_tokens = max_prefill_tokens
        if max_total_tokens is None and self.paging.chunking:
            context = getattr(self.module.config, "max_position_embeddings", None) or self.pool.tokens
            max_total_tokens = min(self.pool.tokens, context, self.tokenizer.model_max_length)
        try:
            _, max_input_tokens, max_total_tokens = super().warmup(batch, max_input_tokens, max_total_tokens)
        finally:
            batch.release()
        return self.pool.tokens, max_input_tokens, max_total_tokens

    @torch.inference_mode()
    def generate_token(
        self, batch: PagedBatch
    ) -> tuple[list[generate_pb2.Generation], PagedBatch | None, tuple[int, int]]:
        start = time.perf_counter_ns()
        prefilling = [c < p for c, p in zip(batch.cache_lengths, batch.prompt_lengths, strict=True)]
        # TGI's flash models: prompt logprobs only with REQUEST_LOGPROBS on, else no request gets prefill tokens.
        want_prompt_logprobs = self.paging.prompt_logprobs and any(
            r.prefill_logprobs and p for r, p in zip(batch.requests, prefilling, strict=True)
        )
        input_ids, positions, step = self._step(batch)
        last = step.cu_seqlens_q[1:].long() - 1  # each row's last new token
        segments = None
        if any(batch.adapter_indices):
            segments = AdapterSegments.of(batch.adapter_indices, batch.chunk_lengths, input_ids.device)
        logits = self.module.forward_paged(
            input_ids, positions, step, None if want_prompt_logprobs else last.to(input_ids.device), segments
        )
        if want_prompt_logprobs:
            self._keep_prompt_logprobs(batch, logits, step.cu_seqlens_q.tolist())
            logits = logits.index_select(0, last.to(logits.device))
        batch.cache_lengths = [c + n for c, n in zip(batch.cache_lengths, batch.chunk_lengths, strict=True)]
        emitting = [i for i, ids in enumerate(batch.all_input_ids) if batch.cache_lengths[i] >= len(ids)]
        chosen = self._choose(batch, emitting, logits)
        forward_ns = time.perf_counter_ns() - start

        decode_start = time.perf_counter_ns()
        generations, stopped = emit_generations(self, batch, emitting, chosen, by_request_id=True)
        self._next_chunks(batch)
        if len(emitting) == len(batch) and all(stopped):
            batch.release()
            return generations, None, (forward_ns, time.perf_counter_ns() - decode_start)
        return generations, batch, (forward_ns, time.perf_counter_ns() - decode_start)

    def _step(self, batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor, PagedStep]:
        """The step's flat token ids and positions, and where attention reads and writes."""
        size, block_size = len(batch), self.paging.block_size
        chunks = torch.tensor(batch.chunk_lengths, dtype=torch.int32)
        cache = torch.tensor(batch.cache_lengths, dtype=torch.int32)
        cu_seqlens = torch.zeros(size + 1, dtype=torch.int32)
        torch.cumsum(chunks, 0, out=cu_seqlens[1:])
        tokens = int(cu_seqlens[-1])
        if tokens == size:  # every row feeds one token: its last
            ids = [row[-1] for row in batch.all_input_ids]
            positions = cache.long()
            rows = torch.arange(size)
        else:
            ids = [t for row, c, n in zip(batch.all_input_ids, batch.cache_lengths, batch.chunk_lengths, strict=True)
                   for t in row[c : c + n]]  # fmt: skip
            rows = torch.repeat_interleave(torch.arange(size), chunks.long())
            positions = cache.long()[rows] + torch.arange(tokens) - cu_seqlens.long()[rows]
        table = batch.block_table_tensor
        slots = table[rows, positions // block_size].long() * block_size + positions % block_size
        device = self.config.device
        step = PagedStep(self.pool, slots.to(device), cu_seqlens, (cache + chunks).long(), table)
        return torch.tensor(ids, dtype=torch.long, device=device), positions.to(device), step

    @staticmethod
    def _keep_prompt_logprobs(batch: PagedBatch, logits: torch.Tensor, cu_seqlens: list[int]) -> None:
        """Add the logprobs of the prompt tokens this step's chunks predicted to each asking row's list."""
        for i, request in enumerate(batch.requests):
            cache, prompt = batch.cache_lengths[i], batch.prompt_lengths[i]
            if not request.prefill_logprobs or cache >= prompt:
                continue
            # Position p's logits predict token p + 1, for the prompt tokens after the chunk's first position.
            # Tokens 1..cache of a prefix-cache hit were never computed here: NaN, as TGI reports the first one.
            kept = batch.prompt_logprobs.setdefault(request.id, [math.nan] * cache)
            targets = batch.all_input_ids[i][cache + 1 : min(cache + batch.chunk_lengths[i], prompt - 1) + 1]
            kept.extend(prompt_logprobs(logits[cu_seqlens[i] : cu_seqlens[i + 1]], targets))

    @staticmethod
    def _choose(batch: PagedBatch, emitting: list[int], logits: torch.Tensor) -> Chosen:
        """Tokens for the rows that emit; the chooser of the others is left as it was (no draw, no history)."""
        chooser = batch.next_token_chooser
        last_ids = torch.tensor([batch.all_input_ids[i][-1] for i in emitting], device=logits.device)
        top_n = [batch.top_n_tokens[i] for i in emitting]
        if len(emitting) == len(batch):
            chosen = choose(chooser, last_ids, logits, top_n, processed_top_n=True)
        else:
            sub = chooser.filter(emitting)
            index = torch.tensor(emitting, dtype=torch.long, device=logits.device)
            chosen = choose(sub, last_ids, logits.index_select(0, index), top_n, processed_top_n=True)
            _write_back_history(chooser, sub, index)
        for i in emitting:
            logprobs = batch.prompt_logprobs.pop(batch.requests[i].id, None)
            if logprobs is not None:
                chosen.prompt_logprobs[i] = logprobs
        return chosen

    def _next_chunks(self, batch: PagedBatch) -> None:
        """Each row's token count for the next forward: 1 once decoding; for a row still prefilling, TGI's rule
        (the step's budget, less one token per other row, shared from the last row back, at least 1 each)."""
        budget = (self.max_prefill_tokens or 0) - (len(batch) - 1)
        chunks = [1] * len(batch)
        for i in reversed(range(len(batch))):
            remaining = batch.prompt_lengths[i] - batch.cache_lengths[i]
            if remaining > 0:
                chunks[i] = max(min(remaining, budget), 1) if self.max_prefill_tokens else remaining
                budget -= chunks[i]
        batch.chunk_lengths = chunks


def _write_back_history(
    chooser: HeterogeneousNextTokenChooser, sub: HeterogeneousNextTokenChooser, index: torch.Tensor
) -> None:
    """The token counts a sub-chooser (a copy of some rows' history) recorded, back into the whole batch's."""
    if chooser.history is not None and sub.history is not None:
        chooser.history.index_copy_(0, index, sub.history)
