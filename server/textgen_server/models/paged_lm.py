"""The paged engine (TGI v3's FlashCausalLM, for CPU first): one forward over every row's new tokens, keys and
values in the shard's KV pool, prefix-cache hits and chunked prefill.

A step: each row feeds its `chunk_lengths[i]` next tokens (the rest of the prompt, a chunk of it, or the last
generated token); the tensor-parallel module writes their keys and values to the row's slots and attends
through its block table (models/tp_llama.py `forward_paged`). Rows whose prompt is now wholly computed choose
a token; rows still prefilling get their next chunk (TGI's rule: the step's prefill budget shared from the
last row back, each at least one token) and emit nothing.

With --speculate N (TGI's n-gram speculation; chunking is then off) a decoding row feeds its last token and up
to N guesses (utils/speculate.py), each attending as a decode row of its own; the row emits the token chosen
after its last one and, while the chosen token is the next guess, the token chosen after that guess. The keys
and values of refused guesses stay in the row's slots past its cache length, to be overwritten.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import threading
import time
from typing import TYPE_CHECKING

import torch

from textgen_pb import generate_pb2
from textgen_server.config import PagingConfig, ShardConfig
from textgen_server.layers.lora import AdapterSegments
from textgen_server.layers.paged_attention import prefill_op_takes, row_key_slots, use_paged_kernel
from textgen_server.models.cuda_graphs import DecodeGraphs
from textgen_server.models.generations import emit_generations, prompt_logprobs
from textgen_server.models.kv_pool import KVPool, free_memory, pool_blocks
from textgen_server.models.model import Model
from textgen_server.models.paged_batch import PagedBatch
from textgen_server.models.tp_llama import PagedStep
from textgen_server.sampling.chooser import Chosen, HeterogeneousNextTokenChooser, choose

if TYPE_CHECKING:
    from textgen_server.models.tp_llama import TPCausalLM
    from textgen_server.tokenizer import ShardTokenizer

logger = logging.getLogger(__name__)


class PagedCausalLM(Model[PagedBatch]):
    """Runs paged steps of a tensor-parallel module (`TPCausalLM`) over this shard's KV pool."""

    def __init__(
        self, module: TPCausalLM, config: ShardConfig, tokenizer: ShardTokenizer, paging: PagingConfig
    ) -> None:
        super().__init__(config, tokenizer)
        self.module = module
        self.paging = paging
        self.adapters = {name: i for i, name in enumerate(module.adapter_names, start=1)}
        self.max_prefill_tokens: int | None = None  # the step's token budget, from Warmup (chunk sizes)
        self._pool: KVPool | None = None
        self.graphs: DecodeGraphs | None = None  # captured at Warmup on a GPU when CUDA_GRAPHS names sizes

    @functools.cached_property
    def _prefill_op(self) -> bool:
        """Whether every layer's rows of several tokens go to the prefill attention op (layers/paged_attention.py)."""
        dtype, device = self.pool.shape.dtype, self.config.device
        return use_paged_kernel(dtype, device) and prefill_op_takes(dtype, self.module.group, self.module.head_dim)

    @property
    def batch_type(self) -> type[PagedBatch]:
        return PagedBatch

    @property
    def pool(self) -> KVPool:
        """The KV pool, sized from the free memory when first needed (Warmup, or the first batch)."""
        if self._pool is None:
            shape = self.module.pool_shape(self.paging.block_size)
            free = free_memory(self.config.device, self.config.world_size, self.paging.wiggle_room)
            blocks = pool_blocks(shape, free)
            self._pool = KVPool(shape, blocks, self.config.device)
            logger.info(
                "KV pool on %s: %d blocks of %d tokens, %.2f GiB (%.2f GiB of free memory allowed)",
                self.config.device,
                blocks,
                shape.block_size,
                blocks * shape.bytes_per_block / 2**30,
                free / 2**30,
            )
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
        info.speculate = self.paging.speculate
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
        device = self.config.device
        if self.paging.cuda_graphs and device.type == "cuda":
            self.graphs = DecodeGraphs(self.module, self.pool, self.paging.cuda_graphs, max_total_tokens, device)
            self.graphs.capture_all()
        return self.pool.tokens, max_input_tokens, max_total_tokens

    def decodes_ahead(self, batch: PagedBatch) -> bool:
        """Whether `decode_logits` can run the batch's next step ahead: on a CPU, one rank (an interrupted forward
        must not leave the other ranks waiting in a collective), every row decoding one token with no guesses."""
        return (
            self.config.device.type == "cpu"
            and self.config.world_size == 1
            and not any(batch.speculative_ids)
            and all(n == 1 for n in batch.chunk_lengths)
            and all(c >= p for c, p in zip(batch.cache_lengths, batch.prompt_lengths, strict=True))
        )

    @torch.inference_mode()
    def decode_logits(self, batch: PagedBatch, interrupt: threading.Event) -> torch.Tensor:
        """The logits of the batch's next decode step (one row each), as `generate_token` computes them, without
        changing the batch; `Interrupted` between two layers once `interrupt` is set. The step writes only its
        rows' next keys and values, into their own blocks at positions no reader has yet: the step that follows
        writes them again."""
        return self._forward(batch, interrupt)[0]

    @torch.inference_mode()
    def generate_token(
        self, batch: PagedBatch, logits: torch.Tensor | None = None
    ) -> tuple[list[generate_pb2.Generation], PagedBatch | None, tuple[int, int]]:
        start = time.perf_counter_ns()
        if logits is None:
            logits, firsts = self._forward(batch, None)
        else:  # decode_logits': one row each
            firsts = list(range(len(batch)))
        guessing = any(batch.speculative_ids)
        cache_lengths = batch.cache_lengths
        batch.cache_lengths = [c + n for c, n in zip(cache_lengths, batch.chunk_lengths, strict=True)]
        emitting = [i for i, ids in enumerate(batch.all_input_ids) if batch.cache_lengths[i] >= len(ids)]
        chosen = self._choose(batch, emitting, logits, firsts)
        if guessing:
            # Keys and values stay for the last real token and the accepted guesses; the rest are overwritten later.
            for k, i in enumerate(emitting):
                if batch.speculative_ids[i]:
                    batch.cache_lengths[i] = cache_lengths[i] + len(chosen.ids[k])
        forward_ns = time.perf_counter_ns() - start

        decode_start = time.perf_counter_ns()
        generations, stopped = emit_generations(self, batch, emitting, chosen, by_request_id=True)
        if self.paging.speculate:
            self._guess(batch, emitting, chosen, stopped)
        self._next_chunks(batch)
        if len(emitting) == len(batch) and all(stopped):
            batch.release()
            return generations, None, (forward_ns, time.perf_counter_ns() - decode_start)
        return generations, batch, (forward_ns, time.perf_counter_ns() - decode_start)

    def _forward(self, batch: PagedBatch, interrupt: threading.Event | None) -> tuple[torch.Tensor, list[int]]:
        """The step's forward: the logits rows choose from, and the index of each row's first among them."""
        prefilling = [c < p for c, p in zip(batch.cache_lengths, batch.prompt_lengths, strict=True)]
        # TGI's flash models: prompt logprobs only with REQUEST_LOGPROBS on, else no request gets prefill tokens.
        want_prompt_logprobs = self.paging.prompt_logprobs and any(
            r.prefill_logprobs and p for r, p in zip(batch.requests, prefilling, strict=True)
        )
        input_ids, positions, step = self._step(batch)
        ends = list(itertools.accumulate(batch.chunk_lengths))
        # The logits rows choose from: each row's last position, and with guesses fed, the positions of its last
        # real token and of each guess (the token after each), row i's first at firsts[i].
        guessing = any(batch.speculative_ids)
        if guessing:
            fed = [
                [end - 1 - len(g) + j for j in range(len(g) + 1)]
                for end, g in zip(ends, batch.speculative_ids, strict=True)
            ]
            firsts = list(itertools.accumulate((len(f) for f in fed[:-1]), initial=0))
            picked = torch.tensor([p for row in fed for p in row])
        else:
            firsts = list(range(len(batch)))
            picked = step.cu_seqlens_q[1:].long() - 1
        segments = None
        if any(batch.adapter_indices):
            segments = AdapterSegments.of(batch.adapter_indices, batch.chunk_lengths, input_ids.device)
        logits = self._logits(
            batch,
            input_ids,
            positions,
            step,
            None if want_prompt_logprobs else picked.to(input_ids.device),
            segments,
            interrupt,
        )
        if want_prompt_logprobs:
            self._keep_prompt_logprobs(batch, logits, [0, *ends])
            logits = logits.index_select(0, picked.to(logits.device))
        return logits, firsts

    def _logits(
        self,
        batch: PagedBatch,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        step: PagedStep,
        logits_index: torch.Tensor | None,
        segments: AdapterSegments | None,
        interrupt: threading.Event | None = None,
    ) -> torch.Tensor:
        """The step's logits at `logits_index` (None: every token's): replayed from a CUDA graph where one fits
        (decode steps only, with no token embedded otherwise), else the module's eager forward (`interrupt`: see
        `decode_logits`)."""
        embeds = self._image_embeds(batch)
        plain = segments is None and embeds is None and logits_index is not None
        if self.graphs is not None and len(input_ids) == len(batch) and plain:
            longest = max(c + n for c, n in zip(batch.cache_lengths, batch.chunk_lengths, strict=True))
            logits = self.graphs.run(input_ids, positions, step, longest)
            if logits is not None:
                return logits
        return self.module.forward_paged(input_ids, positions, step, logits_index, segments, embeds, interrupt)

    def _image_embeds(self, batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Embeddings that replace some of the step's tokens' own, and their indices among the step's tokens: a
        vision-language model's image features (models/paged_vlm.py); none for a text model."""
        return None

    def _positions(self, batch: PagedBatch, positions: torch.Tensor) -> torch.Tensor:
        """The rotary positions of the step's tokens, given their indices in their rows [T]: the indices for a
        text model; a VLM with M-RoPE moves them (models/paged_vlm.py)."""
        return positions

    def _step(self, batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor, PagedStep]:
        """The step's flat token ids and rotary positions, and where attention reads and writes. Everything attention
        reads goes to the device here, once per step: on a GPU a host tensor read per layer would stop the
        stream at every layer."""
        size, block_size = len(batch), self.paging.block_size
        table = batch.block_table_tensor
        device = self.config.device
        if all(n == 1 for n in batch.chunk_lengths):  # every row feeds one token: its last
            # Row metadata from the batch's lists, one tensor each, rather than ~15 small torch ops on tensors of
            # them (benchmark/README.md, "A decode step's row metadata").
            cache = batch.cache_lengths
            ids = [row[-1] for row in batch.all_input_ids]
            positions = torch.tensor(cache, dtype=torch.long)
            lengths = torch.tensor([c + 1 for c in cache], dtype=torch.long)
            slots = torch.tensor(
                [
                    blocks[c // block_size] * block_size + c % block_size
                    for blocks, c in zip(batch.block_tables, cache, strict=True)
                ],
                dtype=torch.long,
            )
            cu_seqlens = torch.arange(size + 1, dtype=torch.int32)
            if device.type != "cpu":
                # The table cut to the live blocks; `decode_rows` reads every column of a table on the device.
                table = table[:, : -(-int(lengths.max()) // block_size)].to(device)
                lengths = lengths.to(device)
            step = PagedStep(self.pool, slots.to(device), cu_seqlens, lengths, table)
            rotary = self._positions(batch, positions).to(device)
            return torch.tensor(ids, dtype=torch.long, device=device), rotary, step
        chunks = torch.tensor(batch.chunk_lengths, dtype=torch.int32)
        cached = torch.tensor(batch.cache_lengths, dtype=torch.int32)
        cu_seqlens = torch.zeros(size + 1, dtype=torch.int32)
        torch.cumsum(chunks, 0, out=cu_seqlens[1:])
        tokens = int(cu_seqlens[-1])
        lengths = (cached + chunks).long()
        ids = [
            t
            for row, guesses, c, n in zip(
                batch.all_input_ids, batch.speculative_ids, batch.cache_lengths, batch.chunk_lengths, strict=True
            )
            for t in (row[c : c + n] if not guesses else (row[-1], *guesses))
        ]
        rows = torch.repeat_interleave(torch.arange(size), chunks.long())
        positions = cached.long()[rows] + torch.arange(tokens) - cu_seqlens.long()[rows]
        slots = table[rows, positions // block_size].long() * block_size + positions % block_size
        if any(batch.speculative_ids):
            # Every fed token attends as a decode row of its own (its row's keys up to its position), so a guess
            # is scored by the same attention as the token decoded alone would be.
            cu_tokens = torch.arange(tokens + 1, dtype=torch.int32)
            step = PagedStep(self.pool, slots.to(device), cu_tokens, positions + 1, table.index_select(0, rows))
        else:
            step = PagedStep(self.pool, slots.to(device), cu_seqlens, lengths, table, self._key_slots(batch, table))
        rotary = self._positions(batch, positions).to(device)
        return torch.tensor(ids, dtype=torch.long, device=device), rotary, step

    def _key_slots(self, batch: PagedBatch, table: torch.Tensor) -> list[torch.Tensor | None]:
        """The keys' slots of each row feeding several tokens (None for the others), for every layer's attention;
        none where the prefill op takes those rows (it reads the block table itself)."""
        several = [i for i, n in enumerate(batch.chunk_lengths) if n > 1]
        out: list[torch.Tensor | None] = [None] * len(batch)
        if several and not self._prefill_op:
            lengths = [batch.cache_lengths[i] + batch.chunk_lengths[i] for i in several]
            found = row_key_slots(table[several], lengths, self.paging.block_size, self.config.device)
            for i, slots in zip(several, found, strict=True):
                out[i] = slots
        return out

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
    def _choose(batch: PagedBatch, emitting: list[int], logits: torch.Tensor, firsts: list[int]) -> Chosen:
        """Tokens for the rows that emit; the chooser of the others is left as it was (no draw, no history).

        Row i's first token is chosen from logits row `firsts[i]`. A row that fed guesses then goes on while its
        guesses match: the token chosen after guess j comes from row `firsts[i] + j + 1`, with the chooser's
        history and generator moved on by exactly the tokens emitted, so a row emits what it would have emitted
        one step at a time (greedy or seeded).
        """
        last_ids = [batch.all_input_ids[i][-1] for i in emitting]
        chosen = _choose_rows(batch, emitting, last_ids, logits, [firsts[i] for i in emitting])
        for i in emitting:
            logprobs = batch.prompt_logprobs.pop(batch.requests[i].id, None)
            if logprobs is not None:
                chosen.prompt_logprobs[i] = logprobs
        guesses = batch.speculative_ids
        # k-th emitting rows whose guess j was the token chosen before it
        going = [k for k, i in enumerate(emitting) if guesses[i] and chosen.ids[k][0] == guesses[i][0]]
        j = 0
        while going:
            rows = [emitting[k] for k in going]
            more = _choose_rows(batch, rows, [guesses[i][j] for i in rows], logits, [firsts[i] + j + 1 for i in rows])
            chosen.extend(going, more)
            j += 1
            going = [
                k
                for k, i, ids in zip(going, rows, more.ids, strict=True)
                if len(guesses[i]) > j and ids[0] == guesses[i][j]
            ]
        return chosen

    def _guess(self, batch: PagedBatch, emitting: list[int], chosen: Chosen, stopped: list[bool]) -> None:
        """Each emitting row's guesses for the next step: at most --speculate, and never more than its
        max_new_tokens leaves after the next token (so a row writes no position past its blocks). A grammar row
        guesses nothing: its matcher can only consume tokens that are chosen."""
        for k, i in enumerate(emitting):
            batch.ngrams[i].record(len(batch.speculative_ids[i]), len(chosen.ids[k]) - 1)
            criteria = batch.stopping_criterias[i]
            limit = min(self.paging.speculate, criteria.max_new_tokens - criteria.current_tokens - 1)
            constrained = batch.requests[i].parameters.grammar_type != generate_pb2.GRAMMAR_TYPE_NONE
            if stopped[k] or constrained:
                limit = 0
            batch.speculative_ids[i] = batch.ngrams[i].propose(batch.all_input_ids[i], limit)

    def _next_chunks(self, batch: PagedBatch) -> None:
        """Each row's token count for the next forward: 1 and its guesses once decoding; for a row still
        prefilling, TGI's rule (the step's budget, less one token per other row, shared from the last row back, at
        least 1 each)."""
        budget = (self.max_prefill_tokens or 0) - (len(batch) - 1)
        chunks = [1 + len(guesses) for guesses in batch.speculative_ids]
        for i in reversed(range(len(batch))):
            remaining = batch.prompt_lengths[i] - batch.cache_lengths[i]
            if remaining > 0:
                chunks[i] = max(min(remaining, budget), 1) if self.max_prefill_tokens else remaining
                budget -= chunks[i]
        batch.chunk_lengths = chunks


def _choose_rows(
    batch: PagedBatch, rows: list[int], last_ids: list[int], logits: torch.Tensor, logit_rows: list[int]
) -> Chosen:
    """One token for each of `rows` (batch rows, in order) from `logits[logit_rows[k]]`, `last_ids[k]` being the
    token before it; a sub-chooser of those rows when they are not the whole batch, its history written back."""
    chooser = batch.next_token_chooser
    device = logits.device
    top_n = [batch.top_n_tokens[i] for i in rows]
    last = torch.tensor(last_ids, device=device)
    if logit_rows != list(range(logits.shape[0])):
        logits = logits.index_select(0, torch.tensor(logit_rows, dtype=torch.long, device=device))
    if len(rows) == len(batch):
        return choose(chooser, last, logits, top_n, processed_top_n=True)
    sub = chooser.filter(rows)
    chosen = choose(sub, last, logits, top_n, processed_top_n=True)
    _write_back_history(chooser, sub, torch.tensor(rows, dtype=torch.long, device=device))
    return chosen


def _write_back_history(
    chooser: HeterogeneousNextTokenChooser, sub: HeterogeneousNextTokenChooser, index: torch.Tensor
) -> None:
    """The token counts a sub-chooser (a copy of some rows' history) recorded, back into the whole batch's."""
    if chooser.history is not None and sub.history is not None:
        chooser.history.index_copy_(0, index, sub.history)
