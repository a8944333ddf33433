"""Registered workers and their liveness state machine. Pure: no I/O, no threads, no clock —
every method that depends on time takes `now` (monotonic seconds) from the caller.

Status of a worker, derived from what it has sent and when:
- `connecting`: registered, nothing received yet;
- `live`: messages arrive within the deadline;
- `resyncing`: an unrecoverable gap cleared it recently; its view rebuilds from what follows;
- `stale`: silent past the deadline (still scored, flagged). A worker known to send heartbeats
  (empty batches — our producer does) is judged by `stale_after_s` and removed after
  `remove_after_s`; an engine that never sent one (idle vLLM/SGLang are simply silent) is judged by
  the looser `stale_after_s * silent_engine_factor` and is never removed automatically.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

from schemas.api import RegisterWorker

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
    m = _ENDPOINT_RE.match(endpoint)
    if m is None:
        raise InvalidRegistration(
            f"invalid {what} {endpoint!r}: expected tcp://host:port, ipc://path or inproc://name"
        )
    port = m.group("port")
    if port is not None and not 0 < int(port) < 65536:
        raise InvalidRegistration(f"invalid {what} {endpoint!r}: port out of range")


class LivenessPolicy:
    __slots__ = ("stale_after_s", "remove_after_s", "silent_engine_factor", "resync_hold_s")

    def __init__(
        self,
        stale_after_s: float = 10.0,
        remove_after_s: float = 300.0,
        silent_engine_factor: float = 6.0,
        resync_hold_s: float = 30.0,
    ) -> None:
        if stale_after_s <= 0 or remove_after_s < stale_after_s:
            raise ValueError("need 0 < stale_after_s <= remove_after_s")
        if silent_engine_factor < 1 or resync_hold_s < 0:
            raise ValueError("need silent_engine_factor >= 1 and resync_hold_s >= 0")
        self.stale_after_s = stale_after_s
        self.remove_after_s = remove_after_s
        self.silent_engine_factor = silent_engine_factor
        self.resync_hold_s = resync_hold_s


class WorkerState:
    """What the indexer knows about one registered worker (publisher)."""

    __slots__ = (
        "reg", "registered_at", "last_msg_at", "last_seq", "lag", "heartbeats", "batches",
        "gaps", "replays", "resyncs", "restarts", "resync_until", "dp_ranks", "reported_status",
        "clean",
    )

    def __init__(self, reg: RegisterWorker, now: float, last_seq: int | None = None) -> None:
        self.reg = reg
        self.registered_at = now
        self.last_msg_at: float | None = None
        self.last_seq = last_seq
        self.lag: float | None = None
        self.heartbeats = 0
        self.batches = 0
        self.gaps = 0
        self.replays = 0
        self.resyncs = 0
        self.restarts = 0
        self.resync_until: float | None = None
        self.dp_ranks: set[int] = {reg.dp_rank}
        self.reported_status = "connecting"
        # False once a loss forced a clear: from then on, stores naming parents from before the
        # clear (orphans) are the expected echo of that loss, not a new one. A reset makes it True.
        self.clean = True

    @property
    def worker_id(self) -> str:
        return self.reg.worker_id

    def silent_for(self, now: float) -> float:
        return now - (self.last_msg_at if self.last_msg_at is not None else self.registered_at)

    def stale_deadline(self, policy: LivenessPolicy) -> float:
        if self.heartbeats:
            return policy.stale_after_s
        return policy.stale_after_s * policy.silent_engine_factor

    def status(self, now: float, policy: LivenessPolicy) -> str:
        if self.silent_for(now) > self.stale_deadline(policy):
            return "stale"
        if self.resync_until is not None and now < self.resync_until:
            return "resyncing"
        if self.last_msg_at is None:
            return "connecting"
        return "live"

    def expired(self, now: float, policy: LivenessPolicy) -> bool:
        # Only workers that proved they heartbeat can be judged dead by silence.
        return self.heartbeats > 0 and self.silent_for(now) > policy.remove_after_s


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

    # -- what arrived ------------------------------------------------------------------------
    def on_batch(
        self, worker_id: str, seq: int, now: float, *, heartbeat: bool, dp_rank: int | None,
        lag: float | None,
    ) -> None:
        w = self._workers.get(worker_id)
        if w is None:
            return
        w.last_seq = seq
        w.last_msg_at = now
        w.batches += 1
        if heartbeat:
            w.heartbeats += 1
        if dp_rank is not None:
            w.dp_ranks.add(dp_rank)
        if lag is not None:
            w.lag = max(0.0, lag)

    def on_gap(self, worker_id: str, now: float, *, recovered: bool) -> None:
        w = self._workers.get(worker_id)
        if w is None:
            return
        w.gaps += 1
        w.last_msg_at = now
        if recovered:
            w.replays += 1
        else:
            w.resyncs += 1
            w.resync_until = now + self.policy.resync_hold_s
            w.clean = False

    def on_orphans(self, worker_id: str, now: float) -> bool:
        """Orphans expired: a parent never arrived. Returns True when the shell must clear the
        worker (first sign of loss on a clean stream); after an earlier clear they only extend the
        `resyncing` window — clearing again would throw away what was rebuilt since."""
        w = self._workers.get(worker_id)
        if w is None:
            return False
        w.resync_until = now + self.policy.resync_hold_s
        if not w.clean:
            return False
        w.clean = False
        w.resyncs += 1
        return True

    def on_reset(self, worker_id: str) -> None:
        """The worker's cache was reset, or it answered a snapshot request (both start with
        AllBlocksCleared): what follows in the batch rebuilds our view exactly, so it is complete
        again and no longer resyncing."""
        w = self._workers.get(worker_id)
        if w is not None:
            w.clean = True
            w.resync_until = None

    def on_restart(self, worker_id: str, now: float) -> None:
        w = self._workers.get(worker_id)
        if w is None:
            return
        w.restarts += 1
        w.last_msg_at = now
        w.last_seq = None
        w.clean = True
        w.resync_until = None

    # -- time passing ------------------------------------------------------------------------
    def tick(self, now: float) -> tuple[list[tuple[str, str, str]], list[str]]:
        """Status transitions since the last tick `(worker, old, new)` and workers past removal."""
        changes: list[tuple[str, str, str]] = []
        expired: list[str] = []
        for w in self._workers.values():
            st = w.status(now, self.policy)
            if st != w.reported_status:
                changes.append((w.worker_id, w.reported_status, st))
                w.reported_status = st
            if w.expired(now, self.policy):
                expired.append(w.worker_id)
        return changes, expired

    def statuses(self, now: float, workers: Iterable[WorkerState] | None = None) -> dict[str, str]:
        return {w.worker_id: w.status(now, self.policy) for w in (workers or self._workers.values())}
