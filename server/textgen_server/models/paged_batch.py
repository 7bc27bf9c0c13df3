"""The paged engine's batch (TGI's FlashCausalLMBatch, for CPU first): rows of flat tokens over a shared KV pool.

A row's keys and values live in the blocks of its block table (models/kv_pool.py); no row is padded. Per row:
`cache_lengths[i]` tokens are already in the pool (a prefix-cache hit, then every computed token), and the
next forward computes `chunk_lengths[i]` more: the whole rest of the prompt, a chunk of it (chunked prefill),
or 1 (decode), plus the row's guesses with --speculate. A row still prefilling emits no token. `filter` and
`concatenate` move block tables, never keys or values.

Contract with the router (generate.v3 `Request`): `blocks` cover every position the request will write
(prompt + max_new_tokens - 1 tokens; a row never guesses past its max_new_tokens, so speculation needs no
more); position p lives in slot `blocks[p // block_size] * block_size + p % block_size` (the router's `slots`
say the same, so the shard derives them from the blocks); `cache_len` leading prompt tokens are already in
those blocks; `chunk_len`, when set, is the first forward's token count.
Requests without blocks get them from the shard's own allocator and give them back when they leave.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from textgen_pb import generate_pb2
from textgen_server.models.kv_pool import KVPool
from textgen_server.models.model import (
    Batch,
    InvalidRequestError,
    KVCacheFullError,
    Model,
    prepare_rows,
    rows_to_keep,
)
from textgen_server.models.vlm_inputs import RowImages
from textgen_server.sampling.chooser import HeterogeneousNextTokenChooser
from textgen_server.sampling.grammar import RowGrammars
from textgen_server.sampling.stopping import StoppingCriteria
from textgen_server.utils.speculate import NGramIndex

if TYPE_CHECKING:
    from typing import Self

    from llguidance import LLMatcher


@dataclass
class _Row:
    """One request of a new batch once checked: prompt ids, matcher, adapter, blocks and cache state."""

    ids: list[int]
    matcher: LLMatcher | None
    adapter: int
    blocks: list[int]
    own_blocks: bool
    cache_len: int
    chunk_len: int
    images: RowImages | None  # a vision-language model's (models/paged_vlm.py)


def _blocks_needed(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _place(request: generate_pb2.Request, ids: list[int], pool: KVPool) -> tuple[list[int], int, int, int]:
    """The request's blocks, the blocks the shard must allocate for it (when it brings none), its cache_len and
    first chunk; ValueError (refusing this request only) when they cannot hold it."""
    # Every position but the last generated token's is written.
    positions = len(ids) + request.stopping_parameters.max_new_tokens - 1
    needed = _blocks_needed(positions, pool.block_size)
    blocks = list(request.blocks)
    if not blocks and request.cache_len:
        raise InvalidRequestError(f"`cache_len` {request.cache_len} needs the blocks that hold those tokens")
    if blocks and len(blocks) < needed:
        raise InvalidRequestError(
            f"{len(blocks)} blocks of {pool.block_size} tokens cannot hold {positions} positions ({needed} needed)"
        )
    if blocks and max(blocks) >= pool.num_blocks:
        raise InvalidRequestError(f"block {max(blocks)} is outside the KV cache ({pool.num_blocks} blocks)")
    if request.cache_len >= len(ids):
        raise InvalidRequestError(f"`cache_len` {request.cache_len} leaves none of the {len(ids)} prompt tokens")
    rest = len(ids) - request.cache_len
    chunk = min(request.chunk_len, rest) if request.HasField("chunk_len") else rest
    if chunk <= 0:
        raise InvalidRequestError("`chunk_len` must be strictly positive")
    return blocks, 0 if blocks else needed, request.cache_len, chunk


def _allocate(rows: list[_Row], wanted: list[int], pool: KVPool) -> None:
    """Give the rows that brought no blocks their own; none of them keeps any if the pool cannot hold all."""
    taken: list[_Row] = []
    try:
        for row, count in zip(rows, wanted, strict=True):
            if count:
                row.blocks, row.own_blocks = pool.allocator.allocate(count), True
                taken.append(row)
    except RuntimeError as error:
        _free_own(taken, pool)
        raise KVCacheFullError(f"Not enough KV cache for this batch: {error}") from None


def _free_own(rows: list[_Row], pool: KVPool) -> None:
    """Give back the blocks the shard allocated for `rows`."""
    for row in rows:
        if row.own_blocks:
            pool.allocator.free(row.blocks)


@dataclass
class PagedBatch(Batch):
    batch_id: int
    requests: list[generate_pb2.Request]
    requests_idx_mapping: dict[int, int]
    pool: KVPool
    all_input_ids: list[list[int]]  # prompt + generated ids of each row
    prompt_lengths: list[int]
    cache_lengths: list[int]  # tokens whose keys and values are in the pool
    chunk_lengths: list[int]  # tokens the next forward computes
    block_tables: list[list[int]]
    own_blocks: list[bool]  # blocks from the pool's SelfAllocator, given back when the row leaves
    prefix_offsets: list[int]
    read_offsets: list[int]
    next_token_chooser: HeterogeneousNextTokenChooser
    stopping_criterias: list[StoppingCriteria]
    top_n_tokens: list[int]
    adapter_indices: list[int]  # each row's LoRA adapter (Model.adapter_index); 0 = the base model
    prompt_logprobs: dict[int, list[float]]  # by request id: prefill logprobs of the chunks computed so far
    # With --speculate: each row's guessed next tokens, fed after its last token by the next forward (so
    # chunk_lengths[i] = 1 + len(speculative_ids[i]) once decoding), and the index its guesses come from.
    speculative_ids: list[list[int]]
    ngrams: list[NGramIndex]
    # A vision-language model's: each row's images until its prompt's last image token is computed, else None.
    images: list[RowImages | None]
    rope_deltas: list[int]  # M-RoPE (models/paged_vlm.py): past a row's last image, a position is index + this
    _block_table_tensor: torch.Tensor | None = field(default=None, init=False)

    @classmethod
    def from_pb(cls, pb: generate_pb2.Batch, model: Model) -> PagedBatch:
        if not pb.requests:
            raise InvalidRequestError("Batch must have at least one request")
        pool: KVPool = model.pool  # type: ignore[attr-defined]  # a paged model (models/paged_lm.py)

        def check(request: generate_pb2.Request) -> tuple[_Row, int]:
            ids, matcher, adapter, images = model.prepare(request)
            blocks, wanted, cache_len, chunk = _place(request, ids, pool)
            return _Row(ids, matcher, adapter, blocks, False, cache_len, chunk, images), wanted

        checked = prepare_rows(pb.requests, check)
        rows = [row for row, _ in checked]
        _allocate(rows, [wanted for _, wanted in checked], pool)
        try:
            return cls._of(pb.id, list(pb.requests), rows, pool, model)
        except BaseException:
            _free_own(rows, pool)
            raise

    @classmethod
    def _of(
        cls, batch_id: int, requests: list[generate_pb2.Request], rows: list[_Row], pool: KVPool, model: Model
    ) -> PagedBatch:
        device = model.config.device
        all_input_ids = [row.ids for row in rows]
        matchers = [row.matcher for row in rows]
        grammars = RowGrammars.of(matchers, model.grammar_compiler, device) if any(matchers) else None
        chooser = HeterogeneousNextTokenChooser.from_pb(
            [r.parameters for r in requests], all_input_ids, model.config.vocab_size, device, grammars
        )
        lengths = [len(ids) for ids in all_input_ids]
        return cls(
            batch_id=batch_id,
            requests=requests,
            requests_idx_mapping={r.id: i for i, r in enumerate(requests)},
            pool=pool,
            all_input_ids=all_input_ids,
            prompt_lengths=lengths,
            cache_lengths=[row.cache_len for row in rows],
            chunk_lengths=[row.chunk_len for row in rows],
            block_tables=[row.blocks for row in rows],
            own_blocks=[row.own_blocks for row in rows],
            prefix_offsets=[max(n - 5, 0) for n in lengths],
            read_offsets=lengths[:],
            next_token_chooser=chooser,
            stopping_criterias=[
                StoppingCriteria.from_pb(r.stopping_parameters, model.config.eos_token_ids) for r in requests
            ],
            top_n_tokens=[r.top_n_tokens for r in requests],
            adapter_indices=[row.adapter for row in rows],
            prompt_logprobs={},
            speculative_ids=[[] for _ in rows],
            ngrams=[NGramIndex() for _ in rows],
            images=[row.images for row in rows],
            rope_deltas=[row.images.rope_delta if row.images is not None else 0 for row in rows],
        )

    def to_pb(self) -> generate_pb2.CachedBatch:
        return generate_pb2.CachedBatch(
            id=self.batch_id,
            request_ids=[r.id for r in self.requests],
            size=len(self),
            max_tokens=sum(len(blocks) for blocks in self.block_tables) * self.pool.block_size,
            current_tokens=sum(self.chunk_lengths),
        )

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(len(ids) for ids in self.all_input_ids)

    @property
    def block_table_tensor(self) -> torch.Tensor:
        """int32 [B, max_blocks], rows padded with block 0; kept until the rows change (filter, concatenate)."""
        if self._block_table_tensor is None:
            width = max(len(blocks) for blocks in self.block_tables)
            table = torch.zeros((len(self), width), dtype=torch.int32)
            for i, blocks in enumerate(self.block_tables):
                table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            self._block_table_tensor = table
        return self._block_table_tensor

    def release(self) -> None:
        """Give the shard's own blocks of every row back to the pool."""
        self._release(range(len(self)))

    def _release(self, rows: range | list[int]) -> None:
        for i in rows:
            if self.own_blocks[i]:
                self.pool.allocator.free(self.block_tables[i])
                self.own_blocks[i] = False

    def filter(self, request_ids: list[int]) -> PagedBatch:
        """Keep `request_ids`, in the batch's order; the shard's own blocks of the other rows go back."""
        keep = rows_to_keep(request_ids, self.requests_idx_mapping, self.batch_id)
        if len(keep) == len(self):
            return self
        kept = set(keep)
        self._release([i for i in range(len(self)) if i not in kept])
        for name in _ROW_LISTS:
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in keep])
        self.requests_idx_mapping = {r.id: i for i, r in enumerate(self.requests)}
        self.next_token_chooser = self.next_token_chooser.filter(keep)
        ids = {r.id for r in self.requests}
        self.prompt_logprobs = {k: v for k, v in self.prompt_logprobs.items() if k in ids}
        if self._block_table_tensor is not None:
            width = max(len(blocks) for blocks in self.block_tables)
            index = torch.tensor(keep, dtype=torch.long)
            self._block_table_tensor = self._block_table_tensor.index_select(0, index)[:, :width].contiguous()
        return self

    @classmethod
    def concatenate(cls, batches: list[Self]) -> Self:
        """All rows of `batches`, in order, under the first batch's id (keys and values stay where they are)."""
        first = batches[0]
        merged = cls(
            batch_id=first.batch_id,
            requests_idx_mapping={},
            pool=first.pool,
            next_token_chooser=HeterogeneousNextTokenChooser.concatenate([b.next_token_chooser for b in batches]),
            prompt_logprobs={k: v for b in batches for k, v in b.prompt_logprobs.items()},
            **{name: [x for b in batches for x in getattr(b, name)] for name in _ROW_LISTS},
        )
        merged.requests_idx_mapping = {r.id: i for i, r in enumerate(merged.requests)}
        return merged


# The per-row lists that filter and concatenate carry along.
_ROW_LISTS = (
    "requests",
    "all_input_ids",
    "prompt_lengths",
    "cache_lengths",
    "chunk_lengths",
    "block_tables",
    "own_blocks",
    "prefix_offsets",
    "read_offsets",
    "stopping_criterias",
    "top_n_tokens",
    "adapter_indices",
    "speculative_ids",
    "ngrams",
    "images",
    "rope_deltas",
)
