"""get_model: from the serve options to a loaded `Model` (one shard of it when sharded).

The shard's assembly, one step above `models/` (which holds the engines and networks it assembles, and imports
nothing back from here): the config (model_config.py), the device and dtype, the refusals of what this shard cannot
run, the tokenizer, the network, its LoRA adapters, and the engine that serves it, each a function below, called in
that order by `get_model`.

This module imports torch at its top: `textgen-server serve` (cli.py) imports it only after `ServeConfig.check`
passed, so a configuration it cannot honour fails at once, not after those imports. transformers is imported by the
paths that use it: a network transformers builds, a VLM's processor, and the config and tokenizer where no earlier
start kept them (model_config.py, tokenizer.py). From its second start on, a Llama-family shard imports no
transformers at all (about 2 s of a tiny shard's start on a 2-core Zen 3).
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from textgen_server.adapters import load_adapters
from textgen_server.config import ServeConfig, ShardConfig, UnsupportedConfigError
from textgen_server.hub import resolve_model_dir
from textgen_server.layers.cpu_ops import x86_bf16_hardware
from textgen_server.layers.quantization import read_quant_config
from textgen_server.layers.quantized_weight import QuantConfig
from textgen_server.layers.rotary import override_rope_scaling
from textgen_server.model_config import ModelConfig, is_vlm, load_config
from textgen_server.models import tp_llama
from textgen_server.models.causal_lm import CausalLM
from textgen_server.models.model import Model
from textgen_server.models.paged_lm import PagedCausalLM
from textgen_server.models.paged_vlm import PagedVlm, drop_language_model, text_model_aliases
from textgen_server.models.tp_llama import TPCausalLM, check_shardable, load_tp_model
from textgen_server.models.vlm_causal_lm import VlmCausalLM
from textgen_server.models.vlm_inputs import MROPE_MODEL_TYPES, VLM_MODEL_TYPES
from textgen_server.tokenizer import FastTokenizer, ShardTokenizer, load_tokenizer
from textgen_server.utils.dist import DistInfo, initialize_torch_distributed

if TYPE_CHECKING:
    from transformers import ProcessorMixin

logger = logging.getLogger(__name__)


def get_model(serve: ServeConfig) -> Model:
    """Load `serve.model_id` for this shard; options it cannot honour raise UnsupportedConfigError."""
    serve.check()
    dist = initialize_torch_distributed() if serve.sharded else DistInfo(0, 1, None)
    device = shard_device(dist.rank)
    # a local dir, or the snapshot download-weights fetched
    model_dir = resolve_model_dir(serve.model_id, serve.revision)
    config = load_config(model_dir, serve.trust_remote_code)  # kept across starts for tp_llama's families
    refuse_unsupported(serve, config)
    quant = quantization(serve, model_dir, config)
    dtype = shard_dtype(serve, device, quant)
    override_rope(serve, config)
    # A VLM's processor holds transformers' tokenizer: the engine decodes with that one too.
    tokenizer = load_tokenizer(model_dir, config, serve.trust_remote_code, keep=not is_vlm(config))
    processor = load_processor(model_dir) if is_vlm(config) else None  # images to the VLM's inputs
    dist.barrier()
    module = load_module(model_dir, config, dtype, device, dist, serve.trust_remote_code, quant)
    vision = None
    if processor is not None and vlm_is_paged(serve, config):
        module, vision = split_vlm(module, model_dir, config, dtype, device, dist)
    attach_adapters(serve, module, config, dist)
    release_freed_memory()
    dist.barrier()
    shard = shard_config(serve, model_dir, config, tokenizer, module, dtype, device, dist)
    return engine(serve, module, shard, tokenizer, processor, vision)


# ---- device and dtype ----


def shard_device(rank: int) -> torch.device:
    """cuda:rank where torch sees a GPU, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    # cuDNN's attention, SDPA's first choice on Hopper, builds an execution plan for every new shape: each prompt
    # length, and each decode step's key count outside the CUDA graphs' fixed widths, cost tens of ms on an H100
    # (benchmark/README.md, "On a GPU"). Flash, memory-efficient and math attention have no such cost.
    torch.backends.cuda.enable_cudnn_sdp(False)
    return torch.device(f"cuda:{rank}")


def shard_dtype(serve: ServeConfig, device: torch.device, quant: QuantConfig | None = None) -> torch.dtype:
    """--dtype, else TGI's default for the device; a warning where the CPU has no native bfloat16."""
    # TGI's defaults: fp16 on GPU, fp32 on plain CPU (half precision matmuls are slow there), bf16 for quantized
    # weights on a CPU (TGI's IPEX path; the packed kernels run bfloat16 only at speed, layers/quant_kernels.py).
    default_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16 if quant else torch.float32
    dtype: torch.dtype = getattr(torch, serve.dtype) if serve.dtype else default_dtype
    if device.type == "cpu" and dtype == torch.bfloat16 and not quant and not x86_bf16_hardware():
        logger.warning(
            "bfloat16 on an x86 CPU without AVX512-BF16 or AMX: no bf16 multiply is native here, and float32 "
            "decodes batches faster (benchmark/README.md); drop --dtype to run float32"
        )
    return dtype


# ---- refusals: what the model's config asks that this shard cannot run ----


def refuse_unsupported(serve: ServeConfig, config: ModelConfig) -> None:
    """UnsupportedConfigError for a vision-language or speculator checkpoint, or --speculate where the padded
    engine would serve."""
    if is_vlm(config):
        refuse_for_vlm(serve, config)
    if getattr(config, "medusa_num_heads", None) or config.model_type == "mlp_speculator":
        raise UnsupportedConfigError(
            f"{serve.model_id} is a speculator (Medusa heads or an MLP speculator), which this shard cannot run; "
            "serve its base model, with --speculate N for n-gram speculation"
        )
    if serve.speculate and not (config.model_type in tp_llama.TP_MODEL_TYPES and serve.use_flash_attention):
        # TGI's CausalLM never speculates either: only the paged engine verifies several tokens per step.
        raise UnsupportedConfigError(
            f"--speculate {serve.speculate} is not supported with the padded CausalLM (model type "
            f"{config.model_type}{', USE_FLASH_ATTENTION=false' if not serve.use_flash_attention else ''}): "
            "only the paged engine speculates"
        )


def refuse_for_vlm(serve: ServeConfig, config: ModelConfig) -> None:
    """UnsupportedConfigError for a vision-language family this shard does not serve (some, as gemma3, mllama
    and llama4, would load as causal LMs and read an image's markdown as text), or an option its engines
    (models/paged_vlm.py, models/vlm_causal_lm.py) cannot honour; only the paged one shards."""
    if config.model_type not in VLM_MODEL_TYPES:
        raise UnsupportedConfigError(
            f"{serve.model_id} is a vision-language model ({config.model_type}), which this shard cannot run: "
            f"of those textgen serves {', '.join(VLM_MODEL_TYPES)}"
        )
    if config.model_type in MROPE_MODEL_TYPES and not vlm_is_paged(serve, config):
        raise UnsupportedConfigError(
            f"USE_FLASH_ATTENTION=false is not supported for {config.model_type}: its M-RoPE positions are placed "
            "by the paged engine only"
        )
    if serve.sharded and not vlm_is_paged(serve, config):
        raise UnsupportedConfigError(
            f"--sharded is not supported for a vision-language model ({config.model_type}) on the padded engine "
            f"(USE_FLASH_ATTENTION=false, or a {config.get_text_config().model_type} language model)"
        )
    options = {
        "--quantize": serve.quantize,
        "--speculate": serve.speculate,
        "LORA_ADAPTERS": serve.lora_adapters,
    }
    for name, value in options.items():
        if value:
            raise UnsupportedConfigError(f"{name} is not supported for a vision-language model ({config.model_type})")


def vlm_is_paged(serve: ServeConfig, config: ModelConfig) -> bool:
    """Whether a vision-language model runs on the paged engine: its language model is of a tensor-parallel
    family (tp_llama's), unless USE_FLASH_ATTENTION=false; else the padded one runs the transformers module."""
    return serve.use_flash_attention and config.get_text_config().model_type in tp_llama.TP_MODEL_TYPES


def override_rope(serve: ServeConfig, config: ModelConfig) -> None:
    """Replace the config's RoPE scaling with ROPE_SCALING / ROPE_FACTOR where set; UnsupportedConfigError where
    the model's rotary embedding cannot take it."""
    rope = serve.rope()
    if rope is None:
        return
    try:
        override_rope_scaling(config, *rope)
    except ValueError as error:
        raise UnsupportedConfigError(f"ROPE_SCALING={serve.rope_scaling}: {error}") from None


def quantization(serve: ServeConfig, model_dir: Path, config: ModelConfig) -> QuantConfig | None:
    """The checkpoint's quantization (--quantize, or what its config says); UnsupportedConfigError where this
    shard cannot serve it. Quantized weights are read by the paged engine's models only."""
    raw = json.loads((model_dir / "config.json").read_text())
    quant = read_quant_config(model_dir, raw, serve.quantize)
    if quant is not None and not (config.model_type in tp_llama.TP_MODEL_TYPES and serve.use_flash_attention):
        raise UnsupportedConfigError(
            f"{quant.method} weights are not supported with the padded CausalLM (model type {config.model_type}"
            f"{', USE_FLASH_ATTENTION=false' if not serve.use_flash_attention else ''}): only the paged engine's "
            "models read quantized checkpoints"
        )
    return quant


# ---- a VLM's processor ----


def load_processor(model_dir: Path) -> ProcessorMixin:
    """A vision-language model's own processor: its images to pixel values and its prompts' image tokens."""
    from textgen_common.image_prompts import load_processor as model_processor  # imports transformers

    processor: ProcessorMixin = model_processor(model_dir)
    return processor


# ---- module ----


def load_module(
    model_dir: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    dist: DistInfo,
    trust_remote_code: bool,
    quant: QuantConfig | None = None,
) -> torch.nn.Module:
    """The network: a forward(input_ids, attention_mask, position_ids, past_key_values, use_cache)
    returning .logits and .past_key_values (a DynamicCache), like a transformers causal LM."""
    if is_vlm(config):  # refuse_unsupported let only the served families and options through
        from transformers import AutoModelForImageTextToText  # see the module's docstring

        vlm = AutoModelForImageTextToText.from_pretrained(model_dir, config=config, dtype=dtype)
        return vlm.to(device).eval()  # type: ignore[arg-type]
    # ---- Tensor-parallel dispatch point (models/tp_llama.py plugs in here) ----
    # Llama-family models take the TP path on one shard too (fused projections, no HF per-call overhead).
    # The family is read from tp_llama at each call, as check_shardable reads it: one set, narrowed in one place
    # (test_rope_scaling.py runs a llama as a model outside it).
    if config.model_type in tp_llama.TP_MODEL_TYPES or dist.world_size > 1:
        try:
            # The same check on every rank, before any collective: all ranks stop with the same clear line.
            check_shardable(config, dist.world_size)
        except ValueError as error:
            raise UnsupportedConfigError(f"--sharded over {dist.world_size} shards: {error}") from error
        return load_tp_model(model_dir, config, dtype, device, dist, quant)
    # ---- end of the dispatch point ----
    from transformers import AutoModelForCausalLM  # see the module's docstring

    # `config`, not the directory's: it carries a ROPE_SCALING override.
    module = AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=dtype, trust_remote_code=trust_remote_code
    )
    # transformers types PreTrainedModel.to as its functools.wraps wrapper, which drops the bound `self`
    return module.to(device).eval()  # type: ignore[arg-type]


def split_vlm(
    vlm: torch.nn.Module,
    model_dir: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    dist: DistInfo,
) -> tuple[TPCausalLM, torch.nn.Module]:
    """A VLM for the paged engine: its language model on tp_llama, read from the checkpoint under its own names
    (this rank's share), and the transformers module without it (the vision tower and projector, whole). The
    transformers language model goes before tp_llama's loads, so the peak is the checkpoint's size, once."""
    text_config = config.get_text_config()
    try:
        check_shardable(text_config, dist.world_size)
    except ValueError as error:
        raise UnsupportedConfigError(f"--sharded over {dist.world_size} shards: {error}") from error
    vision = drop_language_model(vlm)
    release_freed_memory()
    names = [name for path in sorted(model_dir.glob("*.safetensors")) for name in safe_open(str(path), "pt").keys()]
    aliases = text_model_aliases(names, text_config.tie_word_embeddings)
    return load_tp_model(model_dir, text_config, dtype, device, dist, aliases=aliases), vision


# glibc keeps in its heap what the load freed (whole tensors read to be split or unpacked, a quantized weight's
# unpacked integers): ~300 MiB of a 1b GPTQ shard's RSS. Given back before the KV pool is sized from free memory.
_MALLOC_TRIM: Callable[[int], int] | None = getattr(ctypes.CDLL(None), "malloc_trim", None)


def release_freed_memory() -> None:
    """Collect, then return the C heap's free pages to the system (glibc; a no-op elsewhere)."""
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


# ---- adapters ----


def attach_adapters(serve: ServeConfig, module: torch.nn.Module, config: ModelConfig, dist: DistInfo) -> None:
    """Load the LoRA adapters of LORA_ADAPTERS onto the network, where any are listed."""
    adapters = serve.adapters()
    if adapters:
        load_adapters(module, adapters, config, dist)


# ---- engine ----


def shard_config(
    serve: ServeConfig,
    model_dir: Path,
    config: ModelConfig,
    tokenizer: ShardTokenizer,
    module: torch.nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    dist: DistInfo,
) -> ShardConfig:
    """What the loaded shard runs with, as the engine keeps it (`model.config`)."""
    return ShardConfig(
        model_id=serve.model_id,
        dtype=dtype,
        device=device,
        vocab_size=config.get_text_config().vocab_size,
        eos_token_ids=frozenset(eos_token_ids(model_dir, config, tokenizer.eos_token_id)),
        # What transformers resolved at load time; the tensor-parallel modules use SDPA.
        attention_impl=getattr(getattr(module, "config", None), "_attn_implementation", None) or "sdpa",
        block_size=serve.paging().block_size,
        rank=dist.rank,
        world_size=dist.world_size,
        max_input_tokens=serve.max_input_tokens,
    )


def eos_token_ids(model_dir: Path, config: ModelConfig, tokenizer_eos: int | None) -> set[int]:
    """Every id that ends a sequence: generation_config's eos list (chat models have several), the
    config's and the tokenizer's."""
    ids: set[int] = set()
    candidates: list[object] = [config.get_text_config().eos_token_id, tokenizer_eos]  # a VLM's is its text model's
    try:
        candidates.append(json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id"))
    except (OSError, ValueError):
        pass  # no generation_config.json (or not JSON, as GenerationConfig skipped it): the others are all there is
    for candidate in candidates:
        if isinstance(candidate, int):
            ids.add(candidate)
        elif isinstance(candidate, list):
            ids.update(int(c) for c in candidate)
    return ids


def engine(
    serve: ServeConfig,
    module: torch.nn.Module,
    shard: ShardConfig,
    tokenizer: ShardTokenizer,
    processor: ProcessorMixin | None = None,
    vision: torch.nn.Module | None = None,
) -> Model:
    """The paged engine for a tensor-parallel network (unless USE_FLASH_ATTENTION=false), with image inputs for a
    vision-language model (`vision`: its tower, split_vlm), else the padded one (with image inputs for a VLM)."""
    if processor is not None:
        assert not isinstance(tokenizer, FastTokenizer)  # a VLM's is its processor's (get_model)
        if vision is not None:
            assert isinstance(module, TPCausalLM)
            return PagedVlm(module, shard, tokenizer, serve.paging(), vision, processor)
        return VlmCausalLM(module, shard, tokenizer, processor)
    if isinstance(module, TPCausalLM) and serve.use_flash_attention:
        return PagedCausalLM(module, shard, tokenizer, serve.paging())
    return CausalLM(module, shard, tokenizer)
