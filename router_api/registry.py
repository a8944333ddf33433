"""Registered workers: membership, registration checks, and what the API reports per worker.
Pure: no I/O, no threads, no clock.

Each worker's stream state and its status (connecting / live / resyncing / stale, expiry) are the
reconciliation policy's (indexer.reconcile.StreamState, docs/service.md): this module only adds the
registration, dp ranks and lag. `WorkerState.status(now, policy)` is that policy's verdict.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

from indexer.reconcile import LivenessPolicy, StreamState
from schemas.api import RegisterWorker

__all__ = ["LivenessPolicy", "Registry", "RegistryError", "WorkerState", "validate_endpoint"]

_ENDPOINT_RE = re.compile(
    r"^(?:tcp://(?:\*|\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):(?P<port>\d{1,5})"
    r"|ipc://.+|inproc://[A-Za-z0-9_.\-]+)$"
)


class RegistryError(Exception):
    """Base for registration problems; `status` is the HTTP code the API maps it to."""

    status = 400


class InvalidRegistration(RegistryError):
    status = 400


class DuplicateWorker(RegistryError):
    status = 409


class UnknownWorker(RegistryError):
    status = 404


def validate_endpoint(endpoint: str, what: str = "endpoint") -> None:
    if what == "endpoint" and endpoint.startswith("jetstream:"):  # a JetStream worker (docs/jetstream.md)
        from schemas.jetstream import endpoint_subject

        try:
            endpoint_subject(endpoint)
        except ValueError as exc:
            raise InvalidRegistration(f"invalid {what} {endpoint!r}: {exc}") from None
        return
    m = _ENDPOINT_RE.match(endpoint)
    if m is None:
        raise InvalidRegistration(
            f"invalid {what} {endpoint!r}: expected tcp://host:port, ipc://path or inproc://name"
        )
    port = m.group("port")
    if port is not None and not 0 < int(port) < 65536:
        raise InvalidRegistration(f"invalid {what} {endpoint!r}: port out of range")


class WorkerState(StreamState):
    """A registered worker: its registration and what the API reports beyond the stream policy's
    state (indexer.reconcile.StreamState holds liveness, seq and resync state)."""

    __slots__ = ("reg", "lag", "dp_ranks")

    def __init__(self, reg: RegisterWorker, now: float, last_seq: int | None = None) -> None:
        super().__init__(reg.worker_id, now, last_seq)
        self.reg = reg
        self.lag: float | None = None
        self.dp_ranks: set[int] = {reg.dp_rank}


class Registry:
    """Registered workers keyed by worker_id."""

    __slots__ = ("policy", "_workers")

    def __init__(self, policy: LivenessPolicy | None = None) -> None:
        self.policy = policy or LivenessPolicy()
        self._workers: dict[str, WorkerState] = {}

    # -- membership --------------------------------------------------------------------------
    def add(
        self,
        reg: RegisterWorker,
        now: float,
        model_block_sizes: dict[str, int] | None = None,
        last_seq: int | None = None,
    ) -> WorkerState:
        """Validate and add. `model_block_sizes` are block sizes already fixed elsewhere (the index)."""
        if reg.worker_id in self._workers:
            raise DuplicateWorker(f"worker {reg.worker_id!r} is already registered")
        validate_endpoint(reg.endpoint)
        if reg.replay_endpoint is not None:
            validate_endpoint(reg.replay_endpoint, "replay_endpoint")
            if reg.replay_endpoint == reg.endpoint:
                raise InvalidRegistration("replay_endpoint must differ from endpoint")
        known = self.block_size_of(reg.model)
        if known is None and model_block_sizes:
            known = model_block_sizes.get(reg.model)
        if known is not None and known != reg.block_size:
            raise InvalidRegistration(
                f"block_size {reg.block_size} conflicts with model {reg.model!r}, which uses {known}"
            )
        for other in self._workers.values():
            r = other.reg
            if r.endpoint == reg.endpoint and r.topic == reg.topic:
                raise DuplicateWorker(
                    f"endpoint {reg.endpoint} (topic {reg.topic!r}) is already registered as {r.worker_id!r}"
                )
        state = WorkerState(reg, now, last_seq)
        self._workers[reg.worker_id] = state
        return state

    def remove(self, worker_id: str) -> WorkerState:
        try:
            return self._workers.pop(worker_id)
        except KeyError:
            raise UnknownWorker(f"worker {worker_id!r} is not registered") from None

    def get(self, worker_id: str) -> WorkerState | None:
        return self._workers.get(worker_id)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def __len__(self) -> int:
        return len(self._workers)

    def __iter__(self) -> Iterator[WorkerState]:
        return iter(list(self._workers.values()))

    def of_model(self, model: str) -> list[WorkerState]:
        return [w for w in self._workers.values() if w.reg.model == model]

    def block_size_of(self, model: str) -> int | None:
        for w in self._workers.values():
            if w.reg.model == model:
                return w.reg.block_size
        return None

    def models(self) -> dict[str, int]:
        return {w.reg.model: w.reg.block_size for w in self._workers.values()}

    def watermarks(self) -> dict[str, int]:
        return {w.worker_id: w.last_seq for w in self._workers.values() if w.last_seq is not None}

    def statuses(self, now: float, workers: Iterable[WorkerState] | None = None) -> dict[str, str]:
        return {w.worker_id: w.status(now, self.policy) for w in (workers or self._workers.values())}
