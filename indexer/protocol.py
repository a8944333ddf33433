"""The index as the service, ingestion and replay see it: one small `typing.Protocol`.

`indexer.index.KVIndex` is the implementation (on the pure-Python core or the C accelerator, see
docs/index-core.md); tests/support/reference.py is a brute-force model of the same semantics. Code that
only needs an index types against `Index`, so a new backend (or a wrapper adding metrics) drops in
without touching it. The semantics of each method are in docs/CONTRACTS.md (indexer section).
Changes here are additive only: methods are added, never reshaped.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from indexer.core.types import ApplyStats, ScoreResult
from schemas.events import KVEvent, KVEventBatch

# One worker's dump: (worker_id, dp_rank, events), the snapshot format (`Index.dump`).
WorkerDump = tuple[str, int, list[KVEvent]]


@runtime_checkable
class Index(Protocol):
    """What the indexer service (router_api), live ingestion and `indexer.replay` call on an index.

    Callers serialise access (one lock); no method does I/O."""

    @property
    def native(self) -> bool:
        """True when the C accelerator serves this index (an operator-visible fact, not a behaviour)."""
        ...

    # namespaces
    def ensure_model(self, model: str, block_size: int, trust_engine_hashes: bool | None = None) -> None: ...

    def models(self) -> dict[str, int]: ...

    def drop_model(self, model: str) -> bool: ...

    # events
    def apply(self, model: str, worker_id: str, dp_rank: int, batch: KVEventBatch) -> ApplyStats: ...

    def apply_payload(
        self, model: str, worker_id: str, dp_rank: int, payload: bytes, *, rank_from_batch: bool = False,
    ) -> ApplyStats: ...

    def apply_run(
        self, model: str, worker_id: str, rank: int, default_rank: int, payloads: list[bytes],
    ) -> tuple[int, ApplyStats, ApplyStats | None]:
        """Apply a prefix of consecutive raw batches in one call (see `KVIndex.apply_run`); an index
        without a run path returns `(0, ApplyStats(), None)` and the caller goes one by one."""
        ...

    # workers
    def register_worker(self, model: str, worker_id: str, dp_rank: int = 0) -> None: ...

    def clear_worker(self, model: str, worker_id: str, dp_rank: int | None = None) -> int: ...

    def remove_worker(self, model: str, worker_id: str, dp_rank: int | None = None) -> int: ...

    def workers(self, model: str) -> list[tuple[str, int]]: ...

    def worker_stats(self, model: str) -> dict[tuple[str, int], dict[str, int]]: ...

    # queries
    def score(
        self,
        model: str,
        token_ids: Sequence[int] | np.ndarray,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        workers: Iterable[tuple[str, int]] | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> ScoreResult: ...

    # snapshots
    def dump(self, model: str) -> list[WorkerDump]: ...

    def load_dump(self, model: str, block_size: int, dump: list[WorkerDump]) -> int: ...


__all__ = ["Index", "WorkerDump"]
