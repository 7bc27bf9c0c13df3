"""Python client for textgen (and any TGI-compatible server): `Client`, `AsyncClient`."""

from __future__ import annotations

from textgen_client.client import AsyncClient, Client

__all__ = ["AsyncClient", "Client"]
