"""The LoRA adapters of LORA_ADAPTERS, loaded at start onto the tensor-parallel Llama family (tp_llama.py).

An adapter is a PEFT checkpoint: `adapter_config.json` (r, lora_alpha, use_rslora) and
`adapter_model.safetensors` holding `base_model.model.model.layers.{i}.{self_attn|mlp}.{p}_proj.lora_{A|B}.weight`
for p in q/k/v/o (attention) and gate/up/down (MLP). peft itself is not needed: the files are read directly.
Each rank reads only its share of every A and B, split as the base weight is split (see layers/lora.py).

Anything the shard cannot apply exactly (another PEFT method, DoRA, trained biases, per-module ranks, a
module outside the seven, a shape or rank that does not fit the model) is a startup error naming the adapter.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from textgen_common.lora_adapters import LoraAdapter
from textgen_server.config import UnsupportedConfigError
from textgen_server.hub import ModelNotFoundError, resolve_model_dir
from textgen_server.layers.lora import LoraProjection
from textgen_server.layers.rotary import head_size
from textgen_server.layers.tensor_parallel import Linear
from textgen_server.models.tp_llama import DecoderLayer, TPCausalLM
from textgen_server.utils.dist import DistInfo
from textgen_server.utils.weights import Weights

if TYPE_CHECKING:
    from textgen_server.model_config import ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.lora_(A|B)\.weight"
)
# The fused column-parallel matmuls and the pieces they stack, in the order tp_llama.py fuses them.
_FUSED = (("q", "k", "v"), ("gate", "up"))
_ORDER = ("q", "k", "v", "o", "gate", "up", "down")  # checked in this order: the same first error every run
# PEFT settings whose non-default values change what the adapter computes.
_DEFAULTS: dict[str, object] = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "rank_pattern": {},
    "alpha_pattern": {},
    "modules_to_save": None,
}


class AdapterError(UnsupportedConfigError):
    """An adapter of LORA_ADAPTERS that cannot be served: one line naming it (the shard exits)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"LoRA adapter {name}: {reason}")


@dataclass(frozen=True)
class LoraConfig:
    """What this shard needs of a PEFT LoRA `adapter_config.json`."""

    r: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora

    @classmethod
    def load(cls, adapter_dir: Path, name: str) -> LoraConfig:
        try:
            raw = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
        except (OSError, ValueError) as error:
            raise AdapterError(name, f"cannot read {adapter_dir / ADAPTER_CONFIG}: {error}") from None
        if raw.get("peft_type") != "LORA":
            raise AdapterError(name, f"peft_type {raw.get('peft_type')!r} is not LORA")
        for key, default in _DEFAULTS.items():
            if raw.get(key, default) not in (default, None):
                raise AdapterError(name, f"{key}={raw[key]!r} is not supported")
        r, alpha = raw.get("r"), raw.get("lora_alpha")
        if not isinstance(r, int) or r <= 0 or not isinstance(alpha, int | float):
            raise AdapterError(name, f"r={r!r} and lora_alpha={alpha!r} must be a positive integer and a number")
        return cls(r, alpha / r**0.5 if raw.get("use_rslora") else alpha / r)


def adapter_dir(adapter: LoraAdapter) -> Path:
    """Where `adapter`'s files are on this host (a local directory, or the hub snapshot download-weights made)."""
    if adapter.local or Path(adapter.source).is_dir():
        path = Path(adapter.source)
        if not (path / ADAPTER_CONFIG).is_file():
            raise AdapterError(adapter.name, f"{path} has no {ADAPTER_CONFIG}")
        return path
    try:
        return resolve_model_dir(adapter.source, adapter.revision, marker=ADAPTER_CONFIG)
    except ModelNotFoundError as error:
        raise AdapterError(adapter.name, str(error)) from None


def base_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection (q, k, v, o, gate, up, down) of the unsharded model."""
    head_dim = head_size(config)
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {
        "q": (hidden, q),
        "k": (hidden, kv),
        "v": (hidden, kv),
        "o": (q, hidden),
        "gate": (hidden, inter),
        "up": (hidden, inter),
        "down": (inter, hidden),
    }


def load_adapters(model: torch.nn.Module, adapters: list[LoraAdapter], config: ModelConfig, dist: DistInfo) -> None:
    """Load every adapter onto `model` (adapter index i + 1 for `adapters[i]`); AdapterError for the first that
    cannot be served. Every rank checks the same files the same way, so all ranks stop with the same line."""
    if not isinstance(model, TPCausalLM):
        raise UnsupportedConfigError(
            f"LoRA adapters need a Llama-family model served by the tensor-parallel path; model type "
            f"{config.model_type!r} is served by transformers, which applies no adapter"
        )
    shapes = base_shapes(config)
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.dtype
    for index, adapter in enumerate(adapters, start=1):
        path = adapter_dir(adapter)
        lora = LoraConfig.load(path, adapter.name)
        try:
            weights = Weights.from_dir(path, device, dtype, dist.rank, dist.world_size)
        except ValueError as error:
            raise AdapterError(adapter.name, str(error)) from None
        targets = _targets(weights, adapter.name, config.num_hidden_layers)
        for layer, modules in sorted(targets.items()):
            for module in sorted(modules, key=_ORDER.index):
                _check_shapes(weights, adapter.name, layer, module, shapes[module], lora.r)
            block = model.layers[layer]
            assert isinstance(block, DecoderLayer)  # what TPCausalLM's ModuleList holds
            attach = _Attach(weights, layer, lora.scaling, dist)
            attach.column(block.self_attn.qkv, _FUSED[0], modules, shapes, index)
            attach.column(block.mlp.gate_up, _FUSED[1], modules, shapes, index)
            attach.row(block.self_attn.o_proj, "o", modules, index)
            attach.row(block.mlp.down, "down", modules, index)
        model.adapter_names.append(adapter.name)


def lora_key(layer: int, module: str, matrix: str) -> str:
    """PEFT's name of `module`'s (q, ..., down) LoRA `matrix` (A or B) in decoder layer `layer`."""
    group = "self_attn" if module in ("q", "k", "v", "o") else "mlp"
    return f"base_model.model.model.layers.{layer}.{group}.{module}_proj.lora_{matrix}.weight"


def _targets(weights: Weights, name: str, num_layers: int) -> dict[int, set[str]]:
    """Layer -> the projections the adapter changes; every tensor must be an A or B of one of the seven."""
    found: dict[tuple[int, str], set[str]] = {}
    for key in weights.names():
        match = _KEY.fullmatch(key)
        if match is None:
            raise AdapterError(name, f"tensor {key} is not a LoRA A/B of q/k/v/o/gate/up/down_proj")
        layer = int(match[1])
        if layer >= num_layers:
            raise AdapterError(name, f"tensor {key} targets layer {layer}; the model has {num_layers} layers")
        found.setdefault((layer, match[2]), set()).add(match[3])
    targets: dict[int, set[str]] = {}
    for (layer, module), matrices in found.items():
        if matrices != {"A", "B"}:
            raise AdapterError(name, f"layer {layer} {module}_proj has lora_{matrices.pop()} without its pair")
        targets.setdefault(layer, set()).add(module)
    if not targets:
        raise AdapterError(name, "no LoRA weights found")
    return targets


def _check_shapes(weights: Weights, name: str, layer: int, module: str, shape: tuple[int, int], r: int) -> None:
    fan_in, fan_out = shape
    a, b = weights.get_shape(lora_key(layer, module, "A")), weights.get_shape(lora_key(layer, module, "B"))
    if a != [r, fan_in] or b != [fan_out, r]:
        raise AdapterError(
            name,
            f"layer {layer} {module}_proj has lora_A {a} and lora_B {b}; the model and r={r} need "
            f"{[r, fan_in]} and {[fan_out, r]}",
        )


@dataclass
class _Attach:
    """Reads one layer's A/B of one adapter, this rank's share, into the deltas of tp_llama's projections."""

    weights: Weights
    layer: int
    scaling: float
    dist: DistInfo

    def _b_scaled(self, b: torch.Tensor) -> torch.Tensor:
        """B^T with the scaling folded in (in float32, then the model's dtype)."""
        return (b.float() * self.scaling).t().to(b.dtype)

    def column(
        self,
        linear: Linear,
        pieces: tuple[str, ...],
        modules: set[str],
        shapes: dict[str, tuple[int, int]],
        index: int,
    ) -> None:
        """A fused column-parallel matmul: each targeted piece's whole A side by side, and its rows of B (this
        rank's output block) on the block diagonal of `b`, at that piece's place in the fused output."""
        targeted = [p for p in pieces if p in modules]
        if not targeted:
            return
        a_parts: list[torch.Tensor] = []
        blocks: list[tuple[int, torch.Tensor]] = []  # (output offset, scaled B^T block)
        offset = 0
        for piece in pieces:
            width = shapes[piece][1] // self.dist.world_size
            if piece in targeted:
                a_parts.append(self.weights.get_tensor(lora_key(self.layer, piece, "A")).t())
                blocks.append(
                    (offset, self._b_scaled(self.weights.get_sharded(lora_key(self.layer, piece, "B"), dim=0)))
                )
            offset += width
        a = torch.cat(a_parts, dim=1).contiguous()
        b = a.new_zeros((a.shape[1], offset))
        rank_offset = 0
        for out_offset, block in blocks:
            rank, width = block.shape
            b[rank_offset : rank_offset + rank, out_offset : out_offset + width] = block
            rank_offset += rank
        linear.lora[index] = LoraProjection(a, b)

    def row(self, linear: Linear, piece: str, modules: set[str], index: int) -> None:
        """A row-parallel matmul: this rank's input columns of A, the whole B."""
        if piece not in modules:
            return
        a = self.weights.get_sharded(lora_key(self.layer, piece, "A"), dim=1).t().contiguous()
        b = self._b_scaled(self.weights.get_tensor(lora_key(self.layer, piece, "B"))).contiguous()
        linear.lora[index] = LoraProjection(a, b)
