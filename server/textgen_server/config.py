"""The shard's settings: what `textgen-server serve` was asked for, and what the loaded shard runs with.

Two frozen records instead of loose parameters threaded through the CLI, `get_model`, `Model` and the servicer:

- `ServeConfig`: the serve options as given on the command line (strings, as the launcher passes them).
  `check()` refuses what this shard cannot honour before any model is loaded.
- `ShardConfig`: what `get_model` resolved from them and the model's files: the torch dtype and device, the
  vocabulary width and end-of-sequence ids, this shard's place in the tensor-parallel group, and the input
  limit. `Model` keeps it as `model.config`.

torch is imported only for type checking: the CLI builds and checks a ServeConfig before paying for torch.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from textgen_common.cli_values import batch_sizes
from textgen_common.lora_adapters import LoraAdapter, parse_lora_adapters

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "float16", "bfloat16")
# TGI's attention backends and their BLOCK_SIZE (text_generation_server/models/globals.py); on a CPU each is
# served by layers/paged_attention.py with the backend's block size.
BLOCK_SIZES = {"paged": 16, "flashdecoding": 256, "flashinfer": 1, "flashdecoding-ipex": 64}
ATTENTIONS = tuple(BLOCK_SIZES)
# The RoPE scalings TGI's launcher offers (--rope-scaling); both are transformers' init functions, which every
# rotary embedding a shard runs is built with (layers/rotary.py, or transformers' own model classes).
ROPE_SCALINGS = ("linear", "dynamic")


def _env_flag(name: str, default: str) -> bool:
    """TGI's reading of a boolean environment variable: "1" or "true" (any case) is on."""
    return os.environ.get(name, default).lower() in ("1", "true")


# textgen's switch for the shard's decode ahead (decode_ahead.py): on when unset, "1" or "true"; to measure it.
DECODE_AHEAD_ENV = "TEXTGEN_DECODE_AHEAD"

# TGI's switch for the shard's own kernels; textgen-launcher --disable-custom-kernels sets it to "True".
DISABLE_CUSTOM_KERNELS = "DISABLE_CUSTOM_KERNELS"


def custom_kernels_disabled() -> bool:
    """Whether DISABLE_CUSTOM_KERNELS is on (read as the shard's other boolean variables: "1" or "true", any
    case). Then the shard runs none of textgen's own kernels, only torch's ops and `F.linear`: no C++ CPU op
    (layers/cpu_ops.py `switched_on`: decode attention, fused small ops, greedy pick, gemv) and no measured choice
    of linear kernels at load (layers/linear_choice.py `choose_linear_kernels`), whatever TEXTGEN_CPU_LINEAR asks."""
    return _env_flag(DISABLE_CUSTOM_KERNELS, "false")


def parse_cuda_graphs(value: str | None) -> tuple[int, ...]:
    """The batch sizes of CUDA_GRAPHS (a comma list, as the launcher sets it; zeros dropped, as TGI's launcher
    drops them): none when unset, as TGI's shard. ValueError for anything but non-negative integers."""
    if not value:
        return ()
    try:
        sizes = batch_sizes(value)
    except ValueError as error:
        raise ValueError(f"{error}, got {value!r}") from None
    return tuple(sorted({size for size in sizes if size > 0}))


# TGI's TGI_WIGGLE_ROOM default: on a GPU the KV pool takes this share of CUDA_MEMORY_FRACTION (models/kv_pool.py).
WIGGLE_ROOM_DEFAULT = 0.90


def parse_wiggle_room(value: str | None) -> float:
    """TGI_WIGGLE_ROOM: WIGGLE_ROOM_DEFAULT when unset; ValueError unless a number strictly between 0 and 1 (TGI's
    shard asserts the same bounds at import)."""
    if not value:
        return WIGGLE_ROOM_DEFAULT
    try:
        room = float(value)
    except ValueError:
        raise ValueError(f"expected a number between 0 and 1, got {value!r}") from None
    if not 0 < room < 1:
        raise ValueError(f"expected a number between 0 and 1, got {value!r}")
    return room


class UnsupportedConfigError(ValueError):
    """The shard cannot serve the model as asked; the CLI reports it as one clear line and exits."""


@dataclass(frozen=True)
class ServeConfig:
    """The options of `textgen-server serve` (see cli.py for the flags)."""

    model_id: str
    revision: str | None = None
    sharded: bool = False
    quantize: str | None = None
    speculate: int | None = None
    dtype: str | None = None  # one of DTYPES; None: TGI's default for the device
    kv_cache_dtype: str | None = None
    trust_remote_code: bool = False
    max_input_tokens: int | None = None
    uds_path: str = "/tmp/textgen-server"
    otlp_endpoint: str | None = None
    otlp_service_name: str = "text-generation-inference.server"
    lora_adapters: str | None = None  # LORA_ADAPTERS, as TGI's shard reads it (textgen_common.lora_adapters)
    # The paged engine's settings, from the environment the launcher sets (TGI's names and defaults).
    attention: str = "paged"  # ATTENTION
    prefix_caching: bool = False  # PREFIX_CACHING
    prefill_chunking: bool = True  # PREFILL_CHUNKING
    # REQUEST_LOGPROBS (the launcher's --enable-prefill-logprobs): only then does the paged engine compute the
    # prompt logprobs a request asks for, as TGI 3's flash models (a logit row per prompt token is costly).
    request_logprobs: bool = False
    use_flash_attention: bool = True  # USE_FLASH_ATTENTION=false: the padded CausalLM for every model
    # ROPE_SCALING / ROPE_FACTOR as the launcher passes them (--rope-scaling / --rope-factor): they replace the
    # model config's own RoPE scaling, as in TGI's shard.
    rope_scaling: str | None = None
    rope_factor: str | None = None
    # CUDA_GRAPHS as the launcher passes it: the decode batch sizes captured at warmup on a GPU (models/cuda_graphs.py)
    cuda_graphs: str | None = None
    # TGI_WIGGLE_ROOM: the share of the memory fraction the KV pool may take on a GPU
    wiggle_room: str | None = None
    decode_ahead: bool = True  # DECODE_AHEAD_ENV

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeConfig:
        return cls(
            model_id=args.model_id,
            revision=args.revision,
            sharded=args.sharded,
            quantize=args.quantize,
            speculate=args.speculate,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            trust_remote_code=args.trust_remote_code,
            max_input_tokens=args.max_input_tokens,
            uds_path=args.uds_path,
            otlp_endpoint=args.otlp_endpoint,
            otlp_service_name=args.otlp_service_name,
            lora_adapters=os.environ.get("LORA_ADAPTERS") or None,
            attention=os.environ.get("ATTENTION") or "paged",
            prefix_caching=_env_flag("PREFIX_CACHING", "0"),
            prefill_chunking=_env_flag("PREFILL_CHUNKING", "1"),
            request_logprobs=_env_flag("REQUEST_LOGPROBS", "0"),
            use_flash_attention=os.environ.get("USE_FLASH_ATTENTION", "true").lower() not in ("false", "0"),
            rope_scaling=os.environ.get("ROPE_SCALING") or None,
            rope_factor=os.environ.get("ROPE_FACTOR") or None,
            cuda_graphs=os.environ.get("CUDA_GRAPHS") or None,
            wiggle_room=os.environ.get("TGI_WIGGLE_ROOM") or None,
            decode_ahead=_env_flag(DECODE_AHEAD_ENV, "1"),
        )

    def check(self) -> None:
        """Raise UnsupportedConfigError for an option this shard cannot honour."""
        if self.kv_cache_dtype:
            raise UnsupportedConfigError(
                f"--kv-cache-dtype {self.kv_cache_dtype} is not supported: the KV cache uses the model dtype"
            )
        if self.speculate is not None and self.speculate < 0:
            raise UnsupportedConfigError(f"--speculate {self.speculate} is not supported: expected a count >= 0")
        if self.attention not in ATTENTIONS:
            raise UnsupportedConfigError(
                f"ATTENTION={self.attention} is not supported; use one of {', '.join(ATTENTIONS)}"
            )
        if self.dtype is not None and self.dtype not in DTYPES:
            raise UnsupportedConfigError(f"--dtype {self.dtype} is not supported; use one of {', '.join(DTYPES)}")
        self.adapters()
        self.rope()
        for name, parse, value in (
            ("CUDA_GRAPHS", parse_cuda_graphs, self.cuda_graphs),
            ("TGI_WIGGLE_ROOM", parse_wiggle_room, self.wiggle_room),
        ):
            try:
                parse(value)
            except ValueError as error:
                raise UnsupportedConfigError(f"{name}: {error}") from None

    def paging(self) -> PagingConfig:
        """The paged engine's settings (block size as TGI's for the ATTENTION backend; as in TGI, speculation
        turns prefill chunking off)."""
        speculate = self.speculate or 0
        return PagingConfig(
            self.attention,
            BLOCK_SIZES[self.attention],
            self.prefix_caching,
            self.prefill_chunking and not speculate,
            self.request_logprobs,
            speculate,
            parse_cuda_graphs(self.cuda_graphs),
            parse_wiggle_room(self.wiggle_room),
        )

    def rope(self) -> tuple[str, float] | None:
        """The RoPE scaling that replaces the model's: (ROPE_SCALING, ROPE_FACTOR), None when neither is set;
        UnsupportedConfigError for a type no engine here computes, or a half-given or malformed pair (TGI's shard
        ignores a lone ROPE_FACTOR and fails on a lone ROPE_SCALING; the launcher always sends both)."""
        scaling, factor = self.rope_scaling, self.rope_factor
        if scaling is None and factor is None:
            return None
        if scaling is None:
            raise UnsupportedConfigError(f"ROPE_FACTOR={factor} without ROPE_SCALING: set ROPE_SCALING too")
        if scaling not in ROPE_SCALINGS:
            raise UnsupportedConfigError(
                f"ROPE_SCALING={scaling} is not supported; use one of {', '.join(ROPE_SCALINGS)}"
            )
        if factor is None:
            raise UnsupportedConfigError(f"ROPE_SCALING={scaling} needs ROPE_FACTOR, the scaling factor")
        try:
            value = float(factor)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise UnsupportedConfigError(f"ROPE_FACTOR={factor} is not supported: expected a positive number")
        return scaling, value

    def adapters(self) -> list[LoraAdapter]:
        """The entries of LORA_ADAPTERS; UnsupportedConfigError for a malformed list."""
        try:
            return parse_lora_adapters(self.lora_adapters)
        except ValueError as error:
            raise UnsupportedConfigError(f"LORA_ADAPTERS: {error}") from None


@dataclass(frozen=True)
class ShardConfig:
    """What one loaded shard runs with (resolved by `get_model` from a ServeConfig and the model's files)."""

    model_id: str
    dtype: torch.dtype
    device: torch.device
    vocab_size: int  # width of the logits the model returns
    eos_token_ids: frozenset[int]  # every id that ends a sequence
    attention_impl: str = "eager"  # reported by Info
    # TGI's BLOCK_SIZE for the ATTENTION backend, reported by Info whatever the engine: TGI's v3 router rounds its
    # token budgets by it even for a padded shard, and divides by zero on a 0.
    block_size: int = BLOCK_SIZES["paged"]
    rank: int = 0  # this shard's rank in the tensor-parallel group; it reports the rows i % world_size == rank
    world_size: int = 1
    max_input_tokens: int | None = None  # prompts longer than this (after truncation) are refused


@dataclass(frozen=True)
class PagingConfig:
    """The paged engine's settings for a loaded shard (from ServeConfig)."""

    attention: str  # reported by Info
    block_size: int  # tokens per KV block (TGI's BLOCK_SIZE for the attention backend)
    prefix_caching: bool  # Info.use_prefix_caching: the router may send requests with cache_len > 0
    chunking: bool  # Info.support_chunking: the router may send partial prompts and cached batches to Prefill
    prompt_logprobs: bool  # whether a request's prefill_logprobs is honoured (else it gets no prefill tokens)
    speculate: int = 0  # Info.speculate: the most tokens a row guesses per step (utils/speculate.py), 0 for none
    cuda_graphs: tuple[int, ...] = ()  # decode batch sizes replayed from CUDA graphs on a GPU (models/cuda_graphs.py)
    wiggle_room: float = WIGGLE_ROOM_DEFAULT  # TGI_WIGGLE_ROOM: the KV pool's share of the memory fraction on a GPU
