"""Request validation and tokenization: GenerateParameters + inputs -> types.ValidRequest.

Rules, their order and their messages are TGI's (`router/src/validation.rs`); every failure raises
`types.ValidationError` ("Input validation error: ..."), which the routes turn into a 422. Float parameters
arrive as float32 values (schemas.F32), so the rules judge what the shards will compute with.
Tokenization never runs on the event loop: a short input in one of `validation_workers` threads (its GIL hold
is short), a long one in one of `validation_workers` processes (see tokenization.py for why). The processes are
spawned, so, as for any spawned multiprocessing worker, a script that builds a Validator must guard its entry
point with `if __name__ == "__main__":` (each worker imports the parent's main module).

Reused by the OpenAI routes: build a `GenerateParameters`, then `await validator.validate(inputs,
parameters, add_special_tokens=False)` (chat prompts already carry their special tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import random
import sys
import types
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, TypeVar

from textgen_pb import generate_pb2
from textgen_router import grammar, images, metrics, tokenization
from textgen_router.images import ImagePrompts
from textgen_router.schemas import GenerateParameters
from textgen_router.tokenization import Encoding
from textgen_router.tokenizer import Tokenizer
from textgen_router.types import ChooserParameters, StoppingParameters, ValidationError, ValidRequest

logger = logging.getLogger("textgen_router")
T = TypeVar("T")

# Inputs from this many characters are tokenized in a worker process. Below, a thread holds the GIL for a few
# milliseconds at most (encoding rates in benchmark/README.md, "Big inputs"), and the round trip to a process
# would cost a small request more than it saves.
PROCESS_MIN_CHARS = 4096


@dataclass
class Limits:
    """The router's per-request limits (CLI flags, and token limits settled by the shards' Warmup)."""

    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    max_input_tokens: int
    max_total_tokens: int


@dataclass(frozen=True)
class ServedAdapters:
    """The served model's id and the names of the LoRA adapters its shards loaded (the router's
    --lora-adapters, which the launcher passes as it passes LORA_ADAPTERS to the shards)."""

    model_id: str = ""
    names: tuple[str, ...] = ()

    def select(self, requested: str | None) -> str | None:
        """The adapter a request runs with: None (the base model) when `requested` is absent or the model id.

        TGI runs an unknown adapter id on the base model without a word (its issue #2505); refused here.
        """
        if requested is None or requested == self.model_id:
            return None
        if requested not in self.names:
            loaded = ", ".join(self.names) if self.names else "none"
            raise ValidationError(f"adapter `{requested}` is not loaded (loaded LoRA adapters: {loaded})")
        return requested


@contextlib.contextmanager
def bare_main() -> Iterator[None]:
    """Processes spawned inside run none of the parent's main module.

    A spawned child first imports the parent's `__main__` (the `textgen-router` script, or textgen_router.main
    under `python -m`), and with it FastAPI, transformers and the whole router: seconds of CPU per worker, spent
    while the router starts, for a process that needs only `tokenizers` (`tokenization.init_worker`). The child
    takes its instructions from `sys.modules["__main__"]` when it is started; an empty module there gives it none.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class Validator:
    """Validates and tokenizes requests; owns the tokenizer and its worker threads and processes."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        limits: Limits,
        workers: int,
        adapters: ServedAdapters | None = None,
        grammar_support: bool = True,
        images: ImagePrompts | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.images = images  # a vision-language model's processor: its markdown images are images
        self.limits = limits
        self.adapters = adapters or ServedAdapters()
        self.grammar_support = grammar_support  # False under --disable-grammar-support
        self._workers = workers
        # A slow (Python) tokenizer is not thread-safe: TGI then forces one worker. It has no JSON form for a
        # worker process either, so every input stays in that thread.
        self._encoder: Any = tokenizer.encoder
        self._threads = ThreadPoolExecutor(
            max_workers=workers if tokenizer.is_fast else 1, thread_name_prefix="validation"
        )
        self._processes = self._start_processes() if tokenizer.is_fast else None

    def _start_processes(self) -> ProcessPoolExecutor:
        # spawn, not fork: the router runs grpc and executor threads, which a forked child would inherit broken.
        pool = ProcessPoolExecutor(
            max_workers=self._workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=tokenization.init_worker,
            initargs=(self._encoder.to_str(), self._encoder.encode_special_tokens),
        )
        # Started now rather than by the first long input, which would otherwise wait for the spawn.
        with bare_main():
            for _ in range(self._workers):
                pool.submit(int)
        return pool

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self.images is not None:
            self.images.close()
        if self._processes is not None:
            self._processes.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[..., T], inputs: str, *args: Any) -> T:
        """`fn(tokenizer, inputs, *args)` in a worker thread or process; a failure is the input's (422)."""
        loop = asyncio.get_running_loop()
        try:
            if self._processes is None or len(inputs) < PROCESS_MIN_CHARS:
                return await loop.run_in_executor(self._threads, fn, self._encoder, inputs, *args)
            try:
                return await loop.run_in_executor(self._processes, tokenization.in_process, fn, inputs, *args)
            except BrokenProcessPool:
                # A worker died (killed, out of memory): the pool refuses all work from then on. Start a new one
                # and give this input one more try.
                logger.error("A tokenizer worker process died; starting new ones")
                self._processes = self._start_processes()
                return await loop.run_in_executor(self._processes, tokenization.in_process, fn, inputs, *args)
        except BrokenProcessPool:
            raise
        except Exception as err:  # the tokenizer's own failures are the user's input problem
            # Its message names library internals ("TextInputSequence must be str"): logged, not returned.
            logger.info("Tokenization failed: %r", err)
            raise ValidationError("tokenizer error the input could not be tokenized") from None

    async def tokenize(self, inputs: str, add_special_tokens: bool = True, truncate: int | None = None) -> Encoding:
        """The tokens of `inputs` with their character spans; `truncate` keeps the last tokens."""
        return await self._run(tokenization.encode, inputs, add_special_tokens, truncate)

    async def token_list(self, inputs: str, add_special_tokens: bool = True) -> bytes:
        """/tokenize's JSON array of `{"id", "text", "start", "stop"}` (byte offsets), built in the worker."""
        return await self._run(tokenization.token_list, inputs, add_special_tokens)

    def validate_best_of(self, best_of: int) -> int:
        """Checked before any permit is taken, for best_of != 1 on non-streaming routes."""
        if self.limits.max_best_of == 1 and best_of != 1:
            raise ValidationError("`best_of` != 1 is not allowed for this endpoint")
        # TGI runs best_of 0 as a single sequence though this message says it must be > 0: refused here.
        if not 0 < best_of <= self.limits.max_best_of:
            raise ValidationError(f"`best_of` must be > 0 and <= {self.limits.max_best_of}. Given: {best_of}")
        return best_of

    async def validate(
        self, inputs: str, parameters: GenerateParameters, add_special_tokens: bool = True
    ) -> ValidRequest:
        """Apply every rule of TGI's `validate` in its order; tokenize; return the queue-ready request."""
        p = parameters
        adapter_id = self.adapters.select(p.adapter_id)
        best_of = p.best_of if p.best_of is not None else 1
        _check_sampling(p, best_of)
        self._check_stopping(p)
        seed = _seed(p, best_of)
        top_n_tokens = self._top_n_tokens(p)
        self._check_inputs(inputs, p)
        chunks, cache_key = None, None
        if self.images is not None and images.IMAGE_MARKDOWN.search(inputs):
            chunks = await self.images.load(images.split(inputs))
            ids, cache_key = await self.images.ids(chunks, add_special_tokens, p.truncate)
            input_length, input_ids = len(ids), ids if len(ids) <= self.limits.max_input_tokens else []
        else:
            input_length, input_ids = await self._run(
                tokenization.input_ids, inputs, add_special_tokens, p.truncate, self.limits.max_input_tokens
            )
        max_new_tokens = self._check_lengths(p, input_length)
        shard_grammar = self._grammar(p)
        metrics.REQUEST_INPUT_LENGTH.observe(input_length)
        metrics.REQUEST_MAX_NEW_TOKENS.observe(max_new_tokens)
        return ValidRequest(
            inputs=inputs,
            input_ids=input_ids,
            truncate=p.truncate if p.truncate is not None else self.limits.max_input_tokens,
            add_special_tokens=add_special_tokens,
            decoder_input_details=p.decoder_input_details,
            top_n_tokens=top_n_tokens,
            parameters=_chooser(p, seed, shard_grammar),
            stopping_parameters=StoppingParameters(max_new_tokens=max_new_tokens, stop_sequences=list(p.stop)),
            adapter_id=adapter_id,
            chunks=chunks,
            cache_key=cache_key,
        )

    def _grammar(self, p: GenerateParameters) -> grammar.ShardGrammar | None:
        if p.grammar is None:
            return None
        if not self.grammar_support:
            raise ValidationError("grammar is not supported")
        return grammar.to_shard(p.grammar)

    def _check_stopping(self, p: GenerateParameters) -> None:
        if p.max_new_tokens == 0:
            raise ValidationError("`max_new_tokens` must be strictly positive")
        if len(p.stop) > self.limits.max_stop_sequences:
            raise ValidationError(
                f"`stop` supports up to {self.limits.max_stop_sequences} stop sequences. Given: {len(p.stop)}"
            )

    def _top_n_tokens(self, p: GenerateParameters) -> int:
        top_n_tokens = p.top_n_tokens or 0
        if top_n_tokens > self.limits.max_top_n_tokens:
            raise ValidationError(
                f"`top_n_tokens` must be >= 0 and <= {self.limits.max_top_n_tokens}. Given: {top_n_tokens}"
            )
        return top_n_tokens

    def _check_inputs(self, inputs: str, p: GenerateParameters) -> None:
        if not inputs:
            raise ValidationError("`inputs` cannot be empty")
        max_input_tokens = self.limits.max_input_tokens
        if p.truncate is not None and (p.truncate == 0 or p.truncate > max_input_tokens):
            raise ValidationError(
                f"`truncate` must be strictly positive and less than {max_input_tokens}. Given: {p.truncate}"
            )

    def _check_lengths(self, p: GenerateParameters, input_length: int) -> int:
        """The request's max_new_tokens once its prompt's length is known."""
        limits = self.limits
        # TGI v3.0-3.1: an omitted max_new_tokens fills what the context leaves.
        max_new_tokens = (
            p.max_new_tokens if p.max_new_tokens is not None else max(limits.max_total_tokens - input_length, 0)
        )
        if input_length + max_new_tokens > limits.max_total_tokens:
            raise ValidationError(
                f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
                f"Given: {input_length} `inputs` tokens and {max_new_tokens} `max_new_tokens`"
            )
        if input_length > limits.max_input_tokens:
            raise ValidationError(
                f"`inputs` must have less than {limits.max_input_tokens} tokens. Given: {input_length}"
            )
        return max_new_tokens


def _check_sampling(p: GenerateParameters, best_of: int) -> None:
    """The token-choice rules, on float32 values (schemas.F32): 1e-300 is a temperature of 0.0 in a shard."""
    sampling = p.do_sample or any(v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p))
    if best_of > 1 and not sampling:
        raise ValidationError("you must use sampling when `best_of` is > 1")
    if p.temperature is not None and p.temperature <= 0:
        raise ValidationError("`temperature` must be strictly positive")
    if p.repetition_penalty is not None and p.repetition_penalty <= 0:
        raise ValidationError("`repetition_penalty` must be strictly positive")
    if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
        raise ValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
    # 1.0 is the protocol's "off" value, which a user may not ask for explicitly (TGI quirk).
    if p.top_p is not None and not 0.0 < p.top_p < 1.0:
        raise ValidationError("`top_p` must be > 0.0 and < 1.0")
    if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
        raise ValidationError("`typical_p` must be > 0.0 and < 1.0")
    if p.top_k is not None and p.top_k <= 0:
        raise ValidationError("`top_k` must be strictly positive")


def _seed(p: GenerateParameters, best_of: int) -> int:
    if p.seed is None:
        return random.getrandbits(64)
    if best_of > 1:
        raise ValidationError("`seed` must not be set when `best_of` > 1")
    return p.seed


def _chooser(p: GenerateParameters, seed: int, shard_grammar: grammar.ShardGrammar | None) -> ChooserParameters:
    """The shard's token-choice parameters, each omitted one at its "off" value."""
    text, grammar_type = shard_grammar if shard_grammar is not None else ("", generate_pb2.GRAMMAR_TYPE_NONE)
    return ChooserParameters(
        temperature=1.0 if p.temperature is None else p.temperature,
        top_k=p.top_k or 0,
        top_p=1.0 if p.top_p is None else p.top_p,
        typical_p=1.0 if p.typical_p is None else p.typical_p,
        do_sample=p.do_sample,
        seed=seed,
        repetition_penalty=1.0 if p.repetition_penalty is None else p.repetition_penalty,
        frequency_penalty=0.0 if p.frequency_penalty is None else p.frequency_penalty,
        watermark=p.watermark,
        grammar=text,
        grammar_type=grammar_type,
    )
