"""Model files: a local directory, or a hub repository fetched into the Hugging Face cache.

Contract for the `textgen-server download-weights MODEL_ID [--revision R] [--extension .safetensors]
[--auto-convert/--no-auto-convert]` CLI (run by the launcher before the shards start) and for `serve`:

- `download_weights(model_id, revision, extension, auto_convert) -> Path` makes the model's directory complete
  (config, tokenizer files, weights with `extension`; `.bin` converted to safetensors when there are no
  safetensors and `auto_convert`) and returns it. Idempotent: files already present are not fetched again.
- `resolve_model_dir(model_id, revision) -> Path` never touches the network: the local directory, the
  `WEIGHTS_CACHE_OVERRIDE` directory, or the cached hub snapshot.
- Both raise `ModelNotFoundError` whose message is one line meant to be printed as is (exit non-zero).

Environment (read on every call, not at import, so a process can be pointed elsewhere): `HF_ENDPOINT`,
`HF_TOKEN`, `HF_HUB_OFFLINE` (1/true/yes: the cache is the only source), `HUGGINGFACE_HUB_CACHE` then
`HF_HUB_CACHE` (cache root), `WEIGHTS_CACHE_OVERRIDE` (a directory that holds the files; no hub at all).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

CONFIG = "config.json"
# Fetched beside the weights when the repo has them; the router and shards read them from the same snapshot.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
# Top-level weight files whose names say they are not model weights (TGI's filter).
NOT_WEIGHTS = ("arguments", "args", "training")
RETRIES = 5
RETRY_BACKOFF_S = 5.0


class ModelNotFoundError(RuntimeError):
    """The model cannot be found or is incomplete; str() is a one-line message for the user."""


def is_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


def cache_dir() -> Path:
    """The hub cache root: HUGGINGFACE_HUB_CACHE (what the launcher sets), HF_HUB_CACHE, else the default."""
    explicit = os.environ.get("HUGGINGFACE_HUB_CACHE") or os.environ.get("HF_HUB_CACHE")
    if explicit:
        return Path(explicit)
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def weight_names(names: list[str], extension: str) -> list[str]:
    """Top-level files with `extension` that are model weights, sorted (shard order)."""
    return sorted(
        n for n in names if "/" not in n and n.endswith(extension) and not any(word in n for word in NOT_WEIGHTS)
    )


def local_weight_files(model_dir: Path, extension: str = ".safetensors") -> list[Path]:
    """The weight files with `extension` directly in `model_dir`, sorted."""
    names = [p.name for p in model_dir.iterdir() if p.is_file()] if model_dir.is_dir() else []
    return [model_dir / n for n in weight_names(names, extension)]


def _check_complete(model_dir: Path, model_id: str, extension: str) -> Path:
    if not (model_dir / CONFIG).is_file():
        raise ModelNotFoundError(f"Model {model_id} has no {CONFIG} in {model_dir}")
    if not local_weight_files(model_dir, extension):
        raise ModelNotFoundError(f"Model {model_id} has no {extension} weights in {model_dir}")
    return model_dir


def _snapshot_dir(model_id: str, revision: str | None, marker: str = CONFIG) -> Path | None:
    """The cached snapshot holding `model_id`'s `marker` file at `revision` (branch, tag or commit), if any."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model_id)
    except HFValidationError:
        raise ModelNotFoundError(
            f"Model {model_id} is neither a local directory nor a valid model id on the hub"
        ) from None

    found = try_to_load_from_cache(model_id, marker, cache_dir=cache_dir(), revision=revision)
    return Path(found).parent if isinstance(found, str) else None


def resolve_model_dir(model_id: str, revision: str | None = None, marker: str = CONFIG) -> Path:
    """Where `model_id`'s files are on this host, without any network access. Raises ModelNotFoundError.

    `marker`: the file the snapshot must hold (a model's config.json, a LoRA adapter's adapter_config.json)."""
    if Path(model_id).is_dir():
        return Path(model_id)
    override = os.environ.get("WEIGHTS_CACHE_OVERRIDE")
    if override:
        if not Path(override).is_dir():
            raise ModelNotFoundError(f"WEIGHTS_CACHE_OVERRIDE directory {override} does not exist")
        return Path(override)
    snapshot = _snapshot_dir(model_id, revision, marker)
    if snapshot is None:
        raise ModelNotFoundError(
            f"File {marker} of model {model_id} not found in {cache_dir()}. "
            f"Please run `textgen-server download-weights {model_id}` first."
        )
    return snapshot


def _with_retries(what: str, fetch: Callable[[], T]) -> T:
    """Retry transient failures (network, 5xx); a missing repo, revision or file fails at once."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    for attempt in range(1, RETRIES + 1):
        try:
            return fetch()
        except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError, GatedRepoError):
            raise
        except Exception as exc:  # noqa: BLE001 - any other failure may be transient
            if attempt == RETRIES:
                raise
            logger.warning(
                "%s failed (attempt %d/%d): %s; retrying in %.0f s", what, attempt, RETRIES, exc, RETRY_BACKOFF_S
            )
            time.sleep(RETRY_BACKOFF_S)
    raise AssertionError("unreachable")


def _convert(model_dir: Path, model_id: str) -> Path:
    from textgen_server.convert import convert_files

    bins = local_weight_files(model_dir, ".bin")
    if not bins:
        raise ModelNotFoundError(f"Model {model_id} has no .safetensors or .bin weights in {model_dir}")
    logger.warning("No safetensors weights found for model %s; converting %d PyTorch file(s)", model_id, len(bins))
    convert_files(bins)
    return model_dir


def _download_hub(model_id: str, revision: str | None, extension: str, auto_convert: bool) -> Path:
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    endpoint = os.environ.get("HF_ENDPOINT") or None
    token = os.environ.get("HF_TOKEN") or None
    api = HfApi(endpoint=endpoint, token=token)
    try:
        info = _with_retries(f"listing {model_id}", lambda: api.model_info(model_id, revision=revision))
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"Revision {revision} of model {model_id} not found on the hub") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"Model {model_id} is neither a local directory nor a model on the hub ({api.endpoint})"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a network failure after retries: one line for the user
        raise ModelNotFoundError(f"Cannot reach the hub ({api.endpoint}) for model {model_id}: {exc}") from None
    names = [s.rfilename for s in info.siblings or []]
    weights = weight_names(names, extension)
    convert = False
    if not weights and extension == ".safetensors":
        weights = weight_names(names, ".bin")
        convert = True
        if weights and not auto_convert:
            raise ModelNotFoundError(f"Model {model_id} has only .bin weights and --auto-convert is off")
    if not weights:
        raise ModelNotFoundError(f"Model {model_id} has no {extension} weights on the hub")
    if CONFIG not in names:
        raise ModelNotFoundError(f"Model {model_id} has no {CONFIG} on the hub")
    files = [n for n in SIDE_FILES if n in names] + weights
    # Pin the commit listed above so every file comes from one snapshot even if the branch moves meanwhile;
    # the branch ref is still recorded (first file) so offline runs can resolve `revision` later.
    path = Path()
    start = time.monotonic()
    for i, name in enumerate(files, start=1):
        rev = info.sha if i > 1 and info.sha else revision
        try:
            path = Path(
                _with_retries(
                    f"downloading {name}",
                    partial(
                        hf_hub_download,
                        model_id,
                        name,
                        revision=rev,
                        cache_dir=cache_dir(),
                        token=token,
                        endpoint=endpoint,
                    ),
                )
            )
        except Exception as exc:  # noqa: BLE001 - after retries: one line for the user
            raise ModelNotFoundError(f"Download of {name} of model {model_id} failed: {exc}") from None
        elapsed = time.monotonic() - start
        logger.info("Download: [%d/%d] -- ETA: %.2fs", i, len(files), elapsed / i * (len(files) - i))
    snapshot = path.parent
    return _convert(snapshot, model_id) if convert else snapshot


def download_weights(
    model_id: str, revision: str | None = None, extension: str = ".safetensors", auto_convert: bool = True
) -> Path:
    """Make `model_id`'s files present on this host and return their directory. Raises ModelNotFoundError."""
    local = Path(model_id)
    if local.is_dir() or os.environ.get("WEIGHTS_CACHE_OVERRIDE"):
        model_dir = resolve_model_dir(model_id, revision)
        if (
            extension == ".safetensors"
            and auto_convert
            and not local_weight_files(model_dir, extension)
            and local_weight_files(model_dir, ".bin")
        ):
            _convert(model_dir, model_id)
        return _check_complete(model_dir, model_id, extension)
    snapshot = _snapshot_dir(model_id, revision)
    if snapshot is not None and local_weight_files(snapshot, extension):
        logger.info("Files are already present on the host. Skipping download.")
        return snapshot
    if is_offline():
        raise ModelNotFoundError(f"Model {model_id} is not in the hub cache {cache_dir()} and HF_HUB_OFFLINE is set")
    return _download_hub(model_id, revision, extension, auto_convert)
