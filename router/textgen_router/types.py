"""Plain data exchanged between the router's HTTP layer, queue and batching loop.

The HTTP layer turns a request body into a `ValidRequest`; the inference side (queue + batching loop)
answers with a stream of `PrefillEvent` / `IntermediateEvent` / `EndEvent`, or raises an `InferError`.
Neither side imports the other's internals: this module is the whole contract between them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from textgen_pb import generate_pb2

if TYPE_CHECKING:
    from textgen_router.images import Image


@dataclass
class ChooserParameters:
    """Token selection parameters, mirrored 1:1 onto generate.v3 NextTokenChooserParameters."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    do_sample: bool = False
    seed: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    watermark: bool = False
    grammar: str = ""
    grammar_type: generate_pb2.GrammarType = generate_pb2.GRAMMAR_TYPE_NONE


@dataclass
class StoppingParameters:
    """Mirrored 1:1 onto generate.v3 StoppingCriteriaParameters."""

    max_new_tokens: int
    stop_sequences: list[str] = field(default_factory=list)
    ignore_eos_token: bool = False


@dataclass
class ValidRequest:
    """A validated, tokenized request ready for the queue."""

    inputs: str
    input_ids: list[int]
    truncate: int
    add_special_tokens: bool
    decoder_input_details: bool
    top_n_tokens: int
    parameters: ChooserParameters
    stopping_parameters: StoppingParameters
    adapter_id: str | None = None  # a loaded LoRA adapter's name; None runs the base model
    chunks: list[str | Image] | None = None  # the text and images of a prompt with images, in order
    cache_key: list[int] | None = None  # a prompt with images: its prefix-cache key (images.cache_key)

    @property
    def prefix_key(self) -> list[int]:
        """What the prefix cache looks the prompt up by: its ids, an image's tokens keyed by the image."""
        return self.input_ids if self.cache_key is None else self.cache_key

    @property
    def input_length(self) -> int:
        return len(self.input_ids)


@dataclass
class Token:
    id: int
    text: str
    logprob: float  # NaN for the first prefill token
    special: bool = False


@dataclass
class GeneratedText:
    text: str
    generated_tokens: int
    finish_reason: str  # "length" | "eos_token" | "stop_sequence"
    seed: int | None


@dataclass
class PrefillEvent:
    """The prompt tokens with their logprobs (only when decoder_input_details was asked)."""

    tokens: list[Token]


@dataclass
class IntermediateEvent:
    token: Token
    top_tokens: list[Token]


@dataclass
class EndEvent:
    """The last token; `queued` and `start` are time.monotonic() stamps (enqueued, first batch run)."""

    token: Token
    top_tokens: list[Token]
    generated_text: GeneratedText
    queued: float
    start: float


StreamEvent = PrefillEvent | IntermediateEvent | EndEvent

TokenSink = Callable[[IntermediateEvent], bool]
"""A request's synchronous consumer of its IntermediateEvents, called by the batching loop in place of a wake-up of
the request's task (the per-token cost of a stream). Returns True when it took the event; False to have it
delivered through the request's event stream instead, and then False for every later event too, so that the
events keep their order. It must not block or raise; PrefillEvent, EndEvent and errors always go through the
event stream."""


class InferError(Exception):
    """An error with TGI's HTTP status and `error_type`; str(err) is the user-visible message."""

    status_code = 500
    error_type = "unknown"


class GenerationError(InferError):
    status_code = 424
    error_type = "generation"

    def __init__(self, message: str) -> None:
        super().__init__(f"Request failed during generation: {message}")


class OverloadedError(InferError):
    status_code = 429
    error_type = "overloaded"

    def __init__(self) -> None:
        super().__init__("Model is overloaded")


class ValidationError(InferError):
    status_code = 422
    error_type = "validation"

    def __init__(self, message: str) -> None:
        super().__init__(f"Input validation error: {message}")


class IncompleteGenerationError(InferError):
    status_code = 500
    error_type = "incomplete_generation"

    def __init__(self) -> None:
        super().__init__("Incomplete generation")
