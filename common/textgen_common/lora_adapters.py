"""The `--lora-adapters` / `LORA_ADAPTERS` list, read the same way by the launcher, the shards and the router.

Format (TGI's): comma-separated entries, each `id` (a hub id or a local directory), `id@revision`, or
`name=path` (a local directory served under `name`). A request selects an adapter by its `name`: the id
itself for the first two forms.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoraAdapter:
    """One entry of the list: `name` is what `parameters.adapter_id` (or the OpenAI `model`) gives."""

    name: str
    source: str  # a hub id or a local directory
    revision: str | None = None
    local: bool = False  # `name=path`: never downloaded


def parse_lora_adapters(spec: str | None) -> list[LoraAdapter]:
    """The entries of `spec` in order; ValueError `Invalid LoRA adapter format: <entry>` (TGI's message) for a
    malformed entry, and a ValueError naming it for a name given twice."""
    adapters: list[LoraAdapter] = []
    for raw in (spec or "").split(","):
        entry = raw.strip()
        if not entry:
            continue
        if "=" in entry:
            name, _, path = entry.partition("=")
            if not name or not path or "=" in path:
                raise ValueError(f"Invalid LoRA adapter format: {entry}")
            adapter = LoraAdapter(name, path, local=True)
        else:
            if entry.count("@") > 1:
                raise ValueError(f"Invalid LoRA adapter format: {entry}")
            source, _, revision = entry.partition("@")
            if not source:
                raise ValueError(f"Invalid LoRA adapter format: {entry}")
            adapter = LoraAdapter(source, source, revision or None)
        if any(a.name == adapter.name for a in adapters):
            raise ValueError(f"LoRA adapter {adapter.name} is given twice")
        adapters.append(adapter)
    return adapters
