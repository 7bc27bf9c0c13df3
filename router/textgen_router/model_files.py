"""A file of the served model, from its local directory or the hub (cache first): its chat template's files, its
config.json."""

from __future__ import annotations

from pathlib import Path


def model_file(model_id: str, filename: str, revision: str | None) -> Path | None:
    """A file of the model: from its local directory, else from the hub cache / hub (None when absent)."""
    local = Path(model_id)
    if local.is_dir():
        path = local / filename
        return path if path.is_file() else None
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(model_id, filename, revision=revision))
    except Exception:  # noqa: BLE001 - any hub failure means "this optional file is not there"
        return None
