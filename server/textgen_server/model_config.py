"""The model's config as a shard reads it, kept across starts for the families tp_llama runs.

transformers' `AutoConfig` resolves a checkpoint's `config.json` into its family's config class: the family's
defaults for what the file leaves out, and the RoPE parameters in transformers 5's form. For Llama, Mistral and
Qwen2 that class imports transformers' type validators, which import `transformers.activations` and through it
transformers' model loading, `torch.distributed.tensor` (with sympy) and accelerate: about 1.2 s of a tiny Llama
shard's 5-6 s start on a 2-core Zen 3 (benchmark/README.md, "Start-up and the test suite"), for nothing the shard
runs. `AutoTokenizer` loads that class too unless it is given a config.

So for those families (tp_llama.TP_MODEL_TYPES, without a vision tower: textgen's own networks run them) the
shard serves a `KeptConfig` holding every attribute of the resolved config (`to_dict`), and keeps that
dictionary in one file per config under TEXTGEN_CACHE_DIR (textgen_common/cache_dir.py; empty: nothing is kept),
named after a hash of the bytes of `config.json` and transformers' version. A later start reads it without
importing transformers at all (with the shard's kept tokenizer, tokenizer.py: about 2 s of a tiny shard's start).
Every start serves the same kind of object, kept or not: the first start converts what `AutoConfig` made. Other
families, vision-language models and `--trust-remote-code` get `AutoConfig`'s own object, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeAlias

from textgen_common.cache_dir import kept_file, write_whole
from textgen_server.models import tp_llama

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


class KeptConfig(SimpleNamespace):
    """A resolved config's attributes, read where the shard reads transformers' config of a text model."""

    def get_text_config(self) -> KeptConfig:
        """The config itself: a text model's (transformers' method, for the callers that serve VLMs too)."""
        return self

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


# The config a shard reads: AutoConfig's own object, or a KeptConfig (see above).
ModelConfig: TypeAlias = "PretrainedConfig | KeptConfig"


def load_config(model_dir: Path, trust_remote_code: bool) -> ModelConfig:
    """`model_dir`'s config: a kept copy's where an earlier start left one, else `AutoConfig`'s (see above)."""
    path = None if trust_remote_code else _cache_file(model_dir)
    if path is not None:
        with contextlib.suppress(OSError, ValueError):  # none kept yet, or unreadable: resolved again below
            kept = json.loads(path.read_text())
            if kept.get("model_type") in tp_llama.TP_MODEL_TYPES:  # a family textgen still runs itself
                # Another directory may hold the same config.json (a fine-tune of one base): the name is this one's,
                # as AutoConfig gives it (AutoTokenizer matches some hub names against it).
                return KeptConfig(**{**kept, "_name_or_path": str(model_dir)})
    from transformers import AutoConfig  # only where no config was kept (see above)

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    if trust_remote_code or config.model_type not in tp_llama.TP_MODEL_TYPES or is_vlm(config):
        return config
    resolved = config.to_dict()
    if path is not None:
        try:
            write_whole(path, json.dumps(resolved))
        except OSError as error:  # a read-only cache: the next start resolves it again
            logger.warning("Could not keep the resolved config in %s: %s", path, error)
    return KeptConfig(**{**resolved, "_name_or_path": str(model_dir)})


def transformers_config(config: ModelConfig) -> PretrainedConfig:
    """`config` as transformers' own functions read it (its RoPE functions, AutoTokenizer): AutoConfig's object
    itself, or a KeptConfig's attributes in transformers' plain config. Imports transformers."""
    from transformers import PretrainedConfig

    return config if isinstance(config, PretrainedConfig) else PretrainedConfig.from_dict(config.to_dict())


def is_vlm(config: ModelConfig) -> bool:
    """Whether the config has a vision tower (a vision-language model)."""
    return getattr(config, "vision_config", None) is not None


def _cache_file(model_dir: Path) -> Path | None:
    try:
        raw = (model_dir / "config.json").read_bytes()
    except OSError:
        return None  # AutoConfig names what is missing
    digest = hashlib.sha256(raw).hexdigest()
    return kept_file("config", f"{digest}|transformers {importlib.metadata.version('transformers')}")
