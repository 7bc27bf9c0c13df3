"""What every route handler needs, built once at startup and stored on `app.state.router`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from textgen_router.validation import Validator

if TYPE_CHECKING:
    # For the annotation only: the HTTP layer imports this module without the inference side (gRPC, protobuf).
    from textgen_router.infer import Infer


def package_version() -> str:
    try:
        return version("textgen")
    except PackageNotFoundError:
        return "0.0.0"


@dataclass
class RouterState:
    """The inference side (`infer`, the core's Infer), the validator and the served model's facts.

    `model_id` is the --tokenizer-name given to the router (the launcher passes the model id);
    `pipeline_tag` is the hub's, None for local models, which makes POST / return the full text by default.
    """

    infer: Infer
    validator: Validator
    model_id: str
    max_concurrent_requests: int
    max_client_batch_size: int
    validation_workers: int
    model_sha: str | None = None
    pipeline_tag: str | None = None
    compute_type: str = field(default_factory=lambda: os.environ.get("COMPUTE_TYPE", "gpu+optimized"))

    def info(self) -> dict[str, Any]:
        """The body of GET /info, in TGI's field order; `lora_adapters` (not TGI's) only when adapters are loaded."""
        limits = self.validator.limits
        info: dict[str, Any] = {
            "model_id": self.model_id,
            "model_sha": self.model_sha,
            "model_pipeline_tag": self.pipeline_tag,
            "max_concurrent_requests": self.max_concurrent_requests,
            "max_best_of": limits.max_best_of,
            "max_stop_sequences": limits.max_stop_sequences,
            "max_input_tokens": limits.max_input_tokens,
            "max_total_tokens": limits.max_total_tokens,
            "validation_workers": self.validation_workers,
            "max_client_batch_size": self.max_client_batch_size,
            "router": "text-generation-router",
            "version": package_version(),
            "sha": os.environ.get("GIT_SHA"),
            "docker_label": os.environ.get("DOCKER_LABEL"),
        }
        if self.validator.adapters.names:
            info["lora_adapters"] = list(self.validator.adapters.names)
        return info
