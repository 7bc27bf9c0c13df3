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
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from textgen_common.lora_adapters import LoraAdapter, parse_lora_adapters

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "float16", "bfloat16")


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
        )

    def check(self) -> None:
        """Raise UnsupportedConfigError for an option this shard cannot honour."""
        if self.kv_cache_dtype:
            raise UnsupportedConfigError(
                f"--kv-cache-dtype {self.kv_cache_dtype} is not supported: the KV cache uses the model dtype"
            )
        if self.quantize:
            raise UnsupportedConfigError(
                f"--quantize {self.quantize} is not supported: this shard runs transformers models unquantized"
            )
        if self.speculate:
            raise UnsupportedConfigError(
                f"--speculate {self.speculate} is not supported: the padded CausalLM never speculates"
            )
        if self.dtype is not None and self.dtype not in DTYPES:
            raise UnsupportedConfigError(f"--dtype {self.dtype} is not supported; use one of {', '.join(DTYPES)}")
        self.adapters()

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
    rank: int = 0  # this shard's rank in the tensor-parallel group; it reports the rows i % world_size == rank
    world_size: int = 1
    max_input_tokens: int | None = None  # prompts longer than this (after truncation) are refused
