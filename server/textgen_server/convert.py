"""PyTorch `.bin` checkpoints to safetensors, the format the shards load.

`convert_files(bin_files) -> list[Path]` writes `<stem without leading "pytorch_">.safetensors` next to each
`.bin` (`pytorch_model-00001-of-00002.bin` -> `model-00001-of-00002.safetensors`), drops tensors that only
alias another (tied embeddings: the name the config's transformers class re-ties goes), verifies every file by
reloading it, and rewrites a `pytorch_model.bin.index.json` weight map as `model.safetensors.index.json` so
transformers can load the result.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

BIN_INDEX = "pytorch_model.bin.index.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_name(bin_file: Path) -> Path:
    """`pytorch_model.bin` -> `model.safetensors`, beside the original."""
    return bin_file.with_name(bin_file.stem.removeprefix("pytorch_") + ".safetensors")


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    return (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())


def tied_names(model_dir: Path) -> set[str]:
    """Names the model's transformers class re-ties at load (`lm_head.weight` when embeddings are tied)."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return set()
    import transformers

    archs = json.loads(config_file.read_text()).get("architectures") or []
    cls = getattr(transformers, archs[0], None) if archs else None
    return set(getattr(cls, "_tied_weights_keys", None) or ())


def deduplicate(state: dict[str, torch.Tensor], discard: set[str]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Keep one name per tensor that shares its storage with another (safetensors refuses shared storage).

    Among exact aliases (same storage, offset, shape, stride) the kept name is one not in `discard` (the
    class's tied names, which the loader re-ties from the kept source), else the first by name. Partial views
    of a shared storage are cloned into their own. Returns the new state dict and the dropped names.
    """
    groups: dict[tuple[int, int], list[str]] = defaultdict(list)
    for name, tensor in state.items():
        groups[_storage_key(tensor)].append(name)
    kept: dict[str, torch.Tensor] = {}
    dropped: set[str] = set()
    for names in groups.values():
        seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
        for name in sorted(names, key=lambda n: (n in discard, n)):
            t = state[name]
            view = (int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))
            if view in seen:
                dropped.add(name)
                continue
            seen.add(view)
            kept[name] = t.contiguous() if len(names) == 1 else t.clone().contiguous()
    return kept, dropped


def convert_file(bin_file: Path, sf_file: Path, discard: set[str]) -> set[str]:
    """Convert one checkpoint file; returns the tensor names dropped as aliases. Raises on a bad reload."""
    state = torch.load(bin_file, map_location="cpu", weights_only=True)
    if "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    kept, dropped = deduplicate(state, discard)
    save_file(kept, str(sf_file), metadata={"format": "pt"})
    reloaded = load_file(str(sf_file))
    for name, tensor in kept.items():
        if name not in reloaded or not torch.equal(reloaded[name], tensor):
            raise RuntimeError(f"conversion of {bin_file} is corrupted: tensor {name} differs after reload")
    if set(reloaded) != set(kept):
        raise RuntimeError(f"conversion of {bin_file} is corrupted: unexpected tensors after reload")
    return dropped


def convert_files(bin_files: list[Path]) -> list[Path]:
    """Convert each `.bin` file to safetensors next to it; returns the safetensors paths in the same order."""
    out: list[Path] = []
    dropped: set[str] = set()
    discard = tied_names(bin_files[0].parent) if bin_files else set()
    for i, bin_file in enumerate(bin_files, start=1):
        sf_file = safetensors_name(bin_file)
        start = time.monotonic()
        dropped |= convert_file(bin_file, sf_file, discard)
        logger.info("Convert: [%d/%d] -- %s in %.2fs", i, len(bin_files), sf_file.name, time.monotonic() - start)
        out.append(sf_file)
    index = bin_files[0].parent / BIN_INDEX if bin_files else None
    if index is not None and index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {
            name: safetensors_name(Path(file)).name for name, file in data["weight_map"].items() if name not in dropped
        }
        (index.parent / SAFETENSORS_INDEX).write_text(json.dumps(data, indent=2))
    return out
