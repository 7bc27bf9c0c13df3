"""The shard's batch cache: batch id -> live Batch (token ids, KV cache, sampling and stopping state).

The router is the authority on membership: a batch stays here until FilterBatch, ClearCache, or the
Decode that consumes it (which stores the batch it produces under the first batch's id).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from textgen_server.models.model import Batch


class BatchNotFoundError(KeyError):
    """An RPC named a batch id that is not cached (maps to gRPC NOT_FOUND)."""

    def __init__(self, batch_id: int) -> None:
        super().__init__(batch_id)
        self.batch_id = batch_id

    def __str__(self) -> str:
        return f"Batch ID {self.batch_id} not found in cache."


class Cache:
    def __init__(self) -> None:
        self._batches: dict[int, Batch] = {}

    def pop(self, batch_id: int) -> Batch:
        """Remove and return a batch; unknown ids raise BatchNotFoundError."""
        try:
            return self._batches.pop(batch_id)
        except KeyError:
            raise BatchNotFoundError(batch_id) from None

    def set(self, batch: Batch | None) -> None:
        """Store a batch under its id; None (every request finished) stores nothing."""
        if batch is not None:
            self._batches[batch.batch_id] = batch

    def delete(self, batch_id: int) -> None:
        """Drop a batch if present (ClearCache of an unknown id is not an error, as in TGI)."""
        batch = self._batches.pop(batch_id, None)
        if batch is not None:
            batch.release()

    def clear(self) -> None:
        for batch in self._batches.values():
            batch.release()
        self._batches.clear()

    def __len__(self) -> int:
        return len(self._batches)

    def __contains__(self, batch_id: int) -> bool:
        return batch_id in self._batches
