"""The seams the service, ingestion and replay see: the index (`Index`, and `ScoringIndex` for the
service's answer paths) and the event transport (`Subscriber`).

`indexer.index.KVIndex` is the implementation (on the pure-Python core or the C accelerator, see
docs/index-core.md); tests/support/reference.py is a brute-force model of the same semantics. Code that
only needs an index types against `Index`, so a new backend (or a wrapper adding metrics) drops in
without touching it. The semantics of each method are in docs/CONTRACTS.md (indexer section).
Changes here are additive only: methods are added, never reshaped.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from indexer.core.types import ApplyStats, ScoreResult, ScoreTable
from schemas.events import KVEvent, KVEventBatch

if TYPE_CHECKING:  # the deliveries are the ZeroMQ module's structs; importing it here would pull in zmq
    from indexer.deliveries import Delivery

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

    def block_size(self, model: str) -> int | None:
        """`models().get(model)` without the dict (every /score asks)."""
        ...

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
        holders: bool = False,
    ) -> ScoreResult: ...

    # snapshots
    def dump(self, model: str) -> list[WorkerDump]: ...

    def load_dump(self, model: str, block_size: int, dump: list[WorkerDump]) -> int: ...


@runtime_checkable
class ScoringIndex(Index, Protocol):
    """The index the indexer service serves from (`KVIndex`, `ShardedIndex`): `Index`, plus rows
    packed for the C `/score` answer writer and the worker shards its ingest pipelines follow."""

    def score_table(
        self, model: str, token_ids: Sequence[int] | np.ndarray, lora_name: str | None = None,
        cache_salt: str | None = None, workers: Iterable[tuple[str, int]] | None = None, holders: bool = False,
    ) -> ScoreTable | None:
        """`score` with the rows packed (no object per row), or None where only `score` serves;
        `holders`: the rows may be only those that hold something (`worker_ids` the whole order)."""
        ...

    def query_keys(
        self, model: str, token_ids: Sequence[int] | np.ndarray, lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> Sequence[int]:
        """The node keys of a query's full blocks (what its blocks' stores are keyed by)."""
        ...

    def score_keys(self, model: str, keys: list[int], workers: Iterable[tuple[str, int]] | None = None) -> ScoreResult:
        """`score` over node keys already computed by `query_keys`."""
        ...

    @property
    def shard_count(self) -> int:
        """Worker shards whose residency is disjoint (1: unsharded); one ingest pipeline each."""
        ...

    def shard_of(self, worker_id: str) -> int:
        """The shard holding a worker (fixed for the life of the index; 0 when unsharded)."""
        ...


@runtime_checkable
class Subscriber(Protocol):
    """An event transport as live ingestion drives it: `indexer.subscriber.ZmqSubscriber` (ZeroMQ
    PUB/SUB with replay), `indexer.jetstream_subscriber.JetStreamSubscriber` and the
    `RoutedSubscriber` over both. One thread owns it (not thread-safe); see docs/CONTRACTS.md."""

    def add(self, worker_id: str, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
            last_seq: int | None = None) -> None:
        """Subscribe; `last_seq` is the watermark already applied. ValueError when it cannot."""
        ...

    def remove(self, worker_id: str) -> None:
        """Unsubscribe (KeyError for an unknown worker)."""
        ...

    def workers(self) -> list[str]: ...

    def watermark(self, worker_id: str) -> int | None:
        """The last seq delivered for this worker (what a snapshot stores)."""
        ...

    def request_snapshot(self, worker_id: str) -> bool:
        """Ask the worker's publisher to re-publish its state in-stream; False when not sent."""
        ...

    def poll(self, timeout_ms: int) -> list[Delivery]:
        """Wait up to `timeout_ms`, then take what is ready (at most `max_per_poll` messages)."""
        ...

    @property
    def max_per_poll(self) -> int:
        """A poll that returned fewer messages than this has drained every queue."""
        ...

    def frame_drops(self) -> dict[str, int]:
        """Messages dropped below the event layer, by reason (cumulative counts)."""
        ...

    @property
    def stats(self) -> Any:
        """The transport's own counters (a Struct of its kind), for operators."""
        ...

    def close(self) -> None: ...


__all__ = ["Index", "ScoringIndex", "Subscriber", "WorkerDump"]
