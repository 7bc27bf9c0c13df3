"""The two contracts the servicer drives: `Batch` (a cached batch's state) and `Model` (runs steps on it).

The servicer never looks inside either: it builds a batch with `Model.batch_type.from_pb`, runs
`Model.generate_token`, stores the returned batch in the cache, and answers with `Batch.to_pb()`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from textgen_pb import generate_pb2
from textgen_server.config import ShardConfig
from textgen_server.sampling.chooser import validate_parameters
from textgen_server.sampling.grammar import GrammarCompiler

if TYPE_CHECKING:
    from typing import Self

    from llguidance import LLMatcher

    from textgen_server.tokenizer import ShardTokenizer


class InvalidRequestError(ValueError):
    """A request the shard cannot run as asked (maps to gRPC INVALID_ARGUMENT); the shard keeps serving."""


class KVCacheFullError(InvalidRequestError):
    """A new batch needs more KV-cache blocks than the shard's pool has free (requests that came without blocks
    of their own: the shard allocates them)."""


class Interrupted(Exception):
    """A forward stopped between two layers because its interrupt was set (`Model.decode_logits`)."""


class InvalidRequestsError(InvalidRequestError):
    """Some requests of a new batch cannot run as asked; the others could.

    Contract with the router (textgen_router.shard_client parses it): the gRPC details, `str(error)`, are one line
    `request {id}: {reason}` per refused request and nothing else. The refused Prefill cached nothing, so the
    router fails only those requests, each with its reason, and prefills the others again in a new call.
    """

    def __init__(self, reasons: dict[int, str]) -> None:
        self.reasons = reasons
        super().__init__("\n".join(f"request {request_id}: {reason}" for request_id, reason in reasons.items()))


class Batch(ABC):
    """A live batch: token ids, KV cache, sampling and stopping state of every request in it."""

    batch_id: int

    @classmethod
    @abstractmethod
    def from_pb(cls, pb: generate_pb2.Batch, model: Model) -> Batch:
        """Tokenize with `model.tokenizer` and set up a new batch on `model.config.device`. Invalid requests
        raise InvalidRequestsError naming each of them (see `prepare_rows`), a bad batch InvalidRequestError."""

    @abstractmethod
    def to_pb(self) -> generate_pb2.CachedBatch:
        """The ids-only view the router keeps (CachedBatch)."""

    @abstractmethod
    def filter(self, request_ids: list[int]) -> Batch:
        """Keep only `request_ids` (each request's state exact); unknown ids raise InvalidRequestError.

        The kept rows' order is the batch's choice (a cache may move a few rows instead of copying all);
        `to_pb().request_ids` gives it, and generations follow it.
        """

    @classmethod
    @abstractmethod
    def concatenate(cls, batches: list[Self]) -> Self:
        """Merge batches that each ran at least one step into one, under the first batch's id."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of requests in the batch."""

    @property
    @abstractmethod
    def total_tokens(self) -> int:
        """Tokens held for all requests now: every prompt token plus every token generated so far."""

    @abstractmethod
    def release(self) -> None:
        """Give back what the batch holds outside itself (the paged engine's self-allocated KV blocks); called
        when the shard drops the batch."""


def rows_to_keep(request_ids: list[int], rows_by_id: dict[int, int], batch_id: int) -> list[int]:
    """The batch rows of `request_ids`, ascending and each once (a FilterBatch's list, checked): an empty list
    or an id the batch does not hold raises InvalidRequestError."""
    if not request_ids:
        raise InvalidRequestError("Batch must have at least one request")
    unknown = [i for i in request_ids if i not in rows_by_id]
    if unknown:
        raise InvalidRequestError(f"request ids {unknown} are not in batch {batch_id}")
    return sorted({rows_by_id[i] for i in request_ids})


B = TypeVar("B", bound=Batch)
T = TypeVar("T")


def prepare_rows(requests: Sequence[generate_pb2.Request], prepare: Callable[[generate_pb2.Request], T]) -> list[T]:
    """`prepare(request)` of every request, in order. A ValueError refuses that request only: once every request
    was looked at, all refusals are raised together as InvalidRequestsError (so one bad row names itself
    instead of failing its batch-mates)."""
    prepared: list[T] = []
    reasons: dict[int, str] = {}
    for request in requests:
        try:
            prepared.append(prepare(request))
        except ValueError as error:
            reasons[request.id] = " ".join(str(error).split())  # one line per request, as the contract says
    if reasons:
        raise InvalidRequestsError(reasons)
    return prepared


def validate_stopping(request: generate_pb2.Request) -> None:
    """Reject stopping values no batch can honour (sampling values are checked by `validate_parameters`)."""
    if request.stopping_parameters.max_new_tokens == 0:
        raise InvalidRequestError("`max_new_tokens` must be strictly positive")


def request_text(request: generate_pb2.Request) -> str:
    """The prompt: the single text chunk of `input_chunks` (image chunks ignored), else `inputs`."""
    if request.HasField("input_chunks") and request.input_chunks.chunks:
        texts = [c.text for c in request.input_chunks.chunks if c.WhichOneof("chunk") == "text"]
        if len(texts) > 1:
            raise InvalidRequestError("cannot concatenate more than one text chunk")
        text = texts[0] if texts else ""
    else:
        text = request.inputs
    if not text:
        raise InvalidRequestError("the prompt is empty")
    return text


def text_ids(request: generate_pb2.Request, model: Model) -> list[int]:
    """The prompt's token ids, truncated on the left to `truncate` (TGI's side: the prompt's end matters)."""
    ids: list[int] = model.tokenizer(request_text(request), add_special_tokens=request.add_special_tokens)["input_ids"]
    if request.truncate and len(ids) > request.truncate:
        ids = ids[len(ids) - request.truncate :]
    return ids


def prompt_ids(
    request: generate_pb2.Request, model: Model, encode: Callable[[generate_pb2.Request], list[int]] | None = None
) -> list[int]:
    """The request's prompt token ids (`encode`'s, by default `text_ids`), after checking everything about the
    request that could refuse it: stopping and sampling values, the prompt and its length."""
    validate_stopping(request)
    validate_parameters(request.parameters)
    ids = encode(request) if encode is not None else text_ids(request, model)
    max_input_tokens = model.config.max_input_tokens
    if max_input_tokens is not None and len(ids) > max_input_tokens:
        raise InvalidRequestError(f"`inputs` must have less than {max_input_tokens} tokens. Given: {len(ids)}")
    if not ids:
        raise InvalidRequestError("the prompt has no tokens")
    return ids


def prepare_row(
    request: generate_pb2.Request, model: Model, encode: Callable[[generate_pb2.Request], list[int]] | None = None
) -> tuple[list[int], LLMatcher | None, int]:
    """The request's prompt ids (prompt_ids), a matcher at its grammar's start when it has one, and its LoRA
    adapter index."""
    ids = prompt_ids(request, model, encode)
    matcher = model.grammar_compiler.compile(request.parameters) if request.parameters.grammar else None
    return ids, matcher, model.adapter_index(request)


class Model(ABC, Generic[B]):
    """A loaded model shard: runs prefill/decode steps on batches of `batch_type`."""

    def __init__(self, config: ShardConfig, tokenizer: ShardTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.all_special_ids = set(tokenizer.all_special_ids)
        # LoRA adapter name -> index (>= 1) in the model's adapters; set by models that load adapters.
        self.adapters: dict[str, int] = {}

    def prepare(self, request: generate_pb2.Request) -> tuple[list[int], LLMatcher | None, int, Any]:
        """prepare_row's (ids, matcher, adapter index) and what else the engine keeps of the request until its
        prefill (a vision-language model's images; None here)."""
        return (*prepare_row(request, self), None)

    def adapter_index(self, request: generate_pb2.Request) -> int:
        """The request's LoRA adapter: 0 (the base model) when it names none or the model itself, else its
        index; a name this shard did not load is refused, never answered by the base model."""
        if not request.adapter_id or request.adapter_id == self.config.model_id:
            return 0
        index = self.adapters.get(request.adapter_id)
        if index is None:
            loaded = ", ".join(self.adapters) if self.adapters else "none"
            raise InvalidRequestError(f"adapter {request.adapter_id} is not loaded (loaded LoRA adapters: {loaded})")
        return index

    @property
    @abstractmethod
    def batch_type(self) -> type[B]:
        """The Batch class this model consumes."""

    @abstractmethod
    def generate_token(
        self, batch: B, logits: torch.Tensor | None = None
    ) -> tuple[list[generate_pb2.Generation], B | None, tuple[int, int]]:
        """One step: returns this rank's generations, the batch for the next step (None when every
        request stopped) and (forward_ns, decode_ns). `logits`: the step's, from `decode_logits` on the same
        unchanged batch (only where `decodes_ahead` said so)."""

    def decodes_ahead(self, batch: B) -> bool:
        """Whether `decode_logits` can compute the batch's next step before it is asked for (servicer.py)."""
        return False

    def decode_logits(self, batch: B, interrupt: threading.Event) -> torch.Tensor:
        """The logits of the batch's next step, leaving the batch as it is; raises `Interrupted` once `interrupt`
        is set. Only called where `decodes_ahead(batch)`."""
        raise NotImplementedError(f"{type(self).__name__} does not decode ahead")

    @cached_property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles request grammars; built on the first constrained request (ValueError if it cannot be)."""
        return GrammarCompiler(self.tokenizer, self.config.eos_token_ids)

    @property
    def support_chunking(self) -> bool:
        """Whether Prefill takes partial prompts and the router's running batch (`cached_batch`)."""
        return False

    @property
    def info(self) -> generate_pb2.InfoResponse:
        # Padded batches with a transformers KV cache: no paging, so no chunking or prefix cache, and the block size
        # only for the router's budget rounding (as TGI's padded models report it).
        return generate_pb2.InfoResponse(
            requires_padding=True,
            dtype=str(self.config.dtype),
            device_type=self.config.device.type,
            speculate=0,
            support_chunking=self.support_chunking,
            use_prefix_caching=False,
            attention_impl=self.config.attention_impl,
            block_size=self.config.block_size,
        )

    def warmup(
        self,
        batch: B,
        max_input_tokens: int | None,
        max_total_tokens: int | None,
        max_prefill_tokens: int | None = None,
    ) -> tuple[int | None, int, int]:
        """Run the warmup batch's prefill once (the batch is not kept) and settle the token limits.

        Returns (max_supported_total_tokens, max_input_tokens, max_total_tokens). A padded model has no
        KV-cache pool to size, so the first is None (the router then picks its own budget), and no prefill
        chunks to size, so `max_prefill_tokens` is not read. Unset limits default as in TGI: max_total =
        tokens of the warmup batch, max_input = max_total - 1.
        """
        warmup_tokens = batch.total_tokens
        self.generate_token(batch)
        if max_total_tokens is None:
            max_total_tokens = warmup_tokens
        if max_input_tokens is None:
            max_input_tokens = max_total_tokens - 1
        return None, max_input_tokens, max_total_tokens

    def health(self) -> None:
        """A real (tiny) tensor op on the model's device; raises if the device is unusable."""
        probe = torch.ones((2, 2), dtype=self.config.dtype, device=self.config.device)
        if not bool(torch.isfinite(probe @ probe).all()):
            raise RuntimeError(f"health probe on {self.config.device} returned non-finite values")

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids` (the tokenizer's decode, whose declared type also covers batches of id lists)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)  # a flat id list decodes to one string
        return text

    def decode_token(
        self, all_ids: list[int], prefix_offset: int, read_offset: int, skip_special_tokens: bool = False
    ) -> tuple[str, int, int]:
        """Incremental detokenisation: the text the newest token(s) add, and the new offsets.

        Decodes ids[prefix:read] and ids[prefix:]; the difference is the new text. A trailing U+FFFD means
        a multi-byte character is still split across tokens: emit nothing and keep the offsets so the
        next token completes it.
        """
        prefix_text = self.decode(all_ids[prefix_offset:read_offset], skip_special_tokens)
        new_text = self.decode(all_ids[prefix_offset:], skip_special_tokens)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            return new_text[len(prefix_text) :], read_offset, len(all_ids)
        return "", prefix_offset, read_offset
