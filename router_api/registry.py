"""Registered workers: membership, registration checks, and what the API reports per worker.
Pure: no I/O, no threads, no clock.

Each worker's stream state and its status (connecting / live / resyncing / stale, expiry) are the
reconciliation policy's (indexer.reconcile.StreamState, docs/service.md): this module only adds the
registration, dp ranks and lag. `RegisteredWorker.status(now, policy)` is that policy's verdict.
"""
from __future__ import annotations

import ipaddress
import itertools
import os
import re
import socket
from typing import Callable, Iterable, Iterator

from indexer.reconcile import LivenessPolicy, StreamState, status_columns
from schemas.api import DROPPING_WINDOW_S, RegisterWorker, TierBlocks, WorkerStatus
from schemas.rules import TIER_NAMES
from schemas.names import worker_id_problem

__all__ = ["LivenessPolicy", "Registry", "RegistryError", "RegisteredWorker", "endpoint_keys",
           "validate_endpoint", "validate_url", "validate_worker_id"]

_ENDPOINT_RE = re.compile(
    r"^(?:tcp://(?P<host>\*|\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):(?P<port>\d{1,5})"
    r"|ipc://(?P<path>[^\x00-\x1f\x7f]+)|inproc://[A-Za-z0-9_.\-]+)$"
)

_URL_RE = re.compile(
    r"^https?://(?:\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+)(?::(?P<port>\d{1,5}))?(?:/[\x21-\x7e]*)?$"
)

Resolver = Callable[[str, int], list[str]]


class RegistryError(Exception):
    """Base for registration problems; `status` is the HTTP code the API maps it to."""

    status = 400


class InvalidRegistration(RegistryError):
    status = 400


class ConflictingBlockSize(RegistryError):
    """The worker's block size differs from the one its model already uses (HTTP 409: the model's
    block size is fixed by its other workers, or by the indexer's --block-size for its own model;
    every path that adds a worker goes through `Registry.check`)."""

    status = 409


class DuplicateWorker(RegistryError):
    status = 409


class UnknownWorker(RegistryError):
    status = 404


class RegistryFull(RegistryError):
    """The configured registration cap is reached (HTTP 503: retry once workers leave)."""

    status = 503


class SubscribeFailed(RegistryError):
    """The registration was valid but the subscription could not be made (HTTP 503)."""

    status = 503


def validate_worker_id(worker_id: str) -> None:
    problem = worker_id_problem(worker_id)  # the one rule (schemas/names.py), the relay's too
    if problem is not None:
        raise InvalidRegistration(problem)


def resolve_host(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (getaddrinfo; /etc/hosts or DNS)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def validate_endpoint(endpoint: str, what: str = "endpoint") -> re.Match[str]:
    m = _ENDPOINT_RE.match(endpoint)
    if m is None:
        raise InvalidRegistration(
            f"invalid {what} {endpoint!r}: expected tcp://host:port, ipc://path or inproc://name"
        )
    port = m.group("port")
    if port is not None and not 0 < int(port) < 65536:
        raise InvalidRegistration(f"invalid {what} {endpoint!r}: port out of range")
    if m.group("host") == "*":
        raise InvalidRegistration(f"invalid {what} {endpoint!r}: a wildcard host can be bound, not "
                                  "connected to; give the publisher's address")
    return m


def validate_url(url: str) -> None:
    """A worker's HTTP base URL: `http[s]://host[:port][/path]`, printable ASCII, a port in range
    (not resolved here: the router that sends to it does)."""
    m = _URL_RE.match(url)
    if m is None:
        raise InvalidRegistration(f"invalid url {url!r}: expected http[s]://host[:port][/path]")
    port = m.group("port")
    if port is not None and not 0 < int(port) < 65536:
        raise InvalidRegistration(f"invalid url {url!r}: port out of range")


def endpoint_keys(endpoint: str, what: str = "endpoint", resolve: Resolver = resolve_host) -> frozenset[str]:
    """Validate `endpoint` and return the normalised forms it reaches: `tcp://ADDR:PORT` for each
    address the host resolves to, `ipc://` with an absolute normalised path, `inproc://` as is.
    Two registrations whose keys intersect read the same publisher (`tcp://localhost:P` is
    `tcp://127.0.0.1:P`). An unresolvable host is refused. A JetStream worker's
    `jetstream:<subject>` (docs/jetstream.md) is its own key (see `check_jetstream_owner`)."""
    if what == "endpoint" and endpoint.startswith("jetstream:"):
        from schemas.jetstream import endpoint_subject

        try:
            endpoint_subject(endpoint)
        except ValueError as exc:
            raise InvalidRegistration(f"invalid {what} {endpoint!r}: {exc}") from None
        return frozenset({endpoint})
    m = validate_endpoint(endpoint, what)
    if m.group("port") is not None:
        host, port = m.group("host"), int(m.group("port"))
        host = host[1:-1] if host.startswith("[") else host
        try:
            addrs = [str(ipaddress.ip_address(host))]
        except ValueError:
            try:
                addrs = resolve(host, port)
            except (OSError, UnicodeError) as exc:
                raise InvalidRegistration(f"invalid {what} {endpoint!r}: host does not resolve: {exc}") from None
        keys = set()
        for a in addrs:
            ip = ipaddress.ip_address(a.split("%", 1)[0])
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped
            keys.add(f"tcp://[{ip}]:{port}" if ip.version == 6 else f"tcp://{ip}:{port}")
        if not keys:
            raise InvalidRegistration(f"invalid {what} {endpoint!r}: host resolves to no address")
        return frozenset(keys)
    if m.group("path") is not None:
        return frozenset({"ipc://" + os.path.normpath(os.path.abspath(m.group("path")))})
    return frozenset({endpoint})


def check_jetstream_owner(reg: RegisterWorker) -> None:
    """One subject, one worker: a `jetstream:` endpoint must be the worker's own subject
    `<prefix>.<model token>.<worker token>` (schemas.jetstream.event_subject), so no registration
    can claim, and be credited with, another worker's events (a shared consumer routes by subject)."""
    from schemas.jetstream import endpoint_subject, subject_token

    subject = endpoint_subject(reg.endpoint)
    tail = f".{subject_token(reg.model)}.{subject_token(reg.worker_id)}"
    if not subject.endswith(tail) or len(subject) == len(tail):
        raise InvalidRegistration(
            f"endpoint {reg.endpoint!r} is not worker {reg.worker_id!r}'s own subject: a JetStream worker "
            f"of model {reg.model!r} is read from <prefix>{tail}")


class RegisteredWorker(StreamState):
    """A registered worker: its registration and what the API reports beyond the stream policy's
    state (indexer.reconcile.StreamState holds liveness, seq and resync state)."""

    __slots__ = ("reg", "lag", "dp_ranks", "keys", "drops", "dropped_at")

    def __init__(self, reg: RegisterWorker, now: float, last_seq: int | None = None,
                 keys: frozenset[tuple[str, str]] = frozenset()) -> None:
        super().__init__(reg.worker_id, now, last_seq)
        self.reg = reg
        self.keys = keys  # (normalised endpoint, topic): what duplicates are judged by
        self.lag: float | None = None
        # rebound only by `Registry.add_rank` (a frozenset: an in-place add elsewhere would fail loudly
        # instead of leaving the registry's `ranks_version` behind)
        self.dp_ranks: frozenset[int] = frozenset((reg.dp_rank,))
        self.drops: dict[str, int] = {}  # its events the index dropped, by reason (`note_drops`)
        self.dropped_at: float | None = None  # when the last of them was

    def note_drops(self, drops: dict[str, int], now: float) -> int:
        """Count this worker's dropped events by reason; returns how many were added."""
        added = 0
        mine = self.drops
        for reason, n in drops.items():
            if n > 0:
                mine[reason] = mine.get(reason, 0) + n
                added += n
        if added:
            self.dropped_at = now
        return added

    def dropping(self, now: float, window_s: float = DROPPING_WINDOW_S) -> bool:
        """Whether some of its events were dropped within the last `window_s` seconds."""
        return self.dropped_at is not None and now - self.dropped_at < window_s

    def degraded(self, now: float, policy: LivenessPolicy) -> list[str]:
        """Why its rows are not to be trusted now (`GET /health`'s degraded_workers), [] when they are:
        `stale` / `resyncing` (the liveness policy's status), `dropping`, `inexact` (a loss its
        publisher has not answered with its full state)."""
        status = self.status(now, policy)
        why = [status] if status in ("stale", "resyncing") else []
        if self.dropping(now):
            why.append("dropping")
        if not self.clean:
            why.append("inexact")
        return why

    def row(self, now: float, policy: LivenessPolicy, blocks: dict[tuple[str, int], dict[str, int]] | None = None
            ) -> WorkerStatus:
        """Its `GET /workers` row; `blocks`: the index's counts per (worker, rank) and tier."""
        r = self.reg
        totals = dict.fromkeys(TIER_NAMES, 0)
        if blocks:
            for rank in self.dp_ranks:
                for k, n in (blocks.get((self.worker_id, rank)) or {}).items():
                    if k in totals:
                        totals[k] += int(n)
        return WorkerStatus(
            worker_id=r.worker_id, endpoint=r.endpoint, replay_endpoint=r.replay_endpoint, model=r.model,
            block_size=r.block_size, dp_rank=r.dp_rank, topic=r.topic, status=self.status(now, policy),
            last_seq=self.last_seq, lag=self.lag,
            silent_s=None if self.last_msg_at is None else max(0.0, now - self.last_msg_at),
            blocks=TierBlocks(**totals), dp_ranks=sorted(self.dp_ranks), batches=self.batches, gaps=self.gaps,
            replays=self.replays, resyncs=self.resyncs, restarts=self.restarts, exact=self.clean, url=r.url,
            drops=dict(self.drops), dropping=self.dropping(now),
        )


class Registry:
    """Registered workers keyed by worker_id."""

    __slots__ = ("policy", "max_workers", "resolve", "_workers", "_owners", "_models", "ranks_version", "_rank_versions")

    def __init__(self, policy: LivenessPolicy | None = None, max_workers: int = 1024,
                 resolve: Resolver = resolve_host) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be >= 1")
        self.policy = policy or LivenessPolicy()
        self.max_workers = max_workers
        self.resolve = resolve
        self._workers: dict[str, RegisteredWorker] = {}
        # Indexes kept with `_workers`, so a registration's checks and a removal cost that worker, not
        # a pass over the fleet: (endpoint key, topic) -> its worker_id; model -> [block size, workers].
        self._owners: dict[tuple[str, str], str] = {}
        self._models: dict[str, list[int]] = {}
        # Moves with every dp_rank a worker gains (`add_rank`): a score plan built at one value still
        # lists every worker's ranks while it holds (router_api/service.py `_plan`), with no pass over
        # them. A counter's next() is one step under the GIL: two pipelines adding ranks at once never
        # read the same value.
        self._rank_versions = itertools.count(1)
        self.ranks_version = 0

    def add_rank(self, state: RegisteredWorker, rank: int) -> None:
        """Record a dp_rank `state`'s worker publishes or was restored with (ranks only grow)."""
        if rank not in state.dp_ranks:
            state.dp_ranks = state.dp_ranks | {rank}
            self.ranks_version = next(self._rank_versions)  # after the rebind: a plan that sees it sees the rank

    # -- membership --------------------------------------------------------------------------
    def add(
        self,
        reg: RegisterWorker,
        now: float,
        model_block_sizes: dict[str, int] | None = None,
        last_seq: int | None = None,
    ) -> RegisteredWorker:
        """Validate and add. `model_block_sizes` are block sizes already fixed elsewhere (the index)."""
        keys = self.check(reg, model_block_sizes)
        state = RegisteredWorker(reg, now, last_seq, keys)
        self._workers[reg.worker_id] = state
        for k in keys:
            self._owners[k] = reg.worker_id
        self._models.setdefault(reg.model, [reg.block_size, 0])[1] += 1
        return state

    def check(self, reg: RegisterWorker, model_block_sizes: dict[str, int] | None = None,
              replacing: str | None = None) -> frozenset[tuple[str, str]]:
        """Raise the RegistryError `add` would, changing nothing; `replacing`: judge as if that
        registered worker were gone first (a changed registration). Returns the duplicate keys."""
        validate_worker_id(reg.worker_id)
        gone = self._workers.get(replacing) if replacing is not None else None
        if reg.worker_id in self._workers and reg.worker_id != replacing:
            raise DuplicateWorker(f"worker {reg.worker_id!r} is already registered")
        n_others = len(self._workers) - (gone is not None)
        if n_others >= self.max_workers:
            raise RegistryFull(f"{n_others} workers registered: the limit (max_workers) is "
                               f"{self.max_workers}")
        if not reg.topic.isprintable() or not reg.model.isprintable():
            raise InvalidRegistration("model and topic must be printable")
        if reg.url is not None:
            validate_url(reg.url)
        ep_keys = endpoint_keys(reg.endpoint, resolve=self.resolve)
        if reg.replay_endpoint is not None:
            if endpoint_keys(reg.replay_endpoint, "replay_endpoint", resolve=self.resolve) & ep_keys:
                raise InvalidRegistration("replay_endpoint must differ from endpoint")
        model = self._models.get(reg.model)
        known = model[0] if model and model[1] - (gone is not None and gone.reg.model == reg.model) > 0 else None
        if known is None and model_block_sizes:
            known = model_block_sizes.get(reg.model)
        if known is not None and known != reg.block_size:
            raise ConflictingBlockSize(
                f"block_size {reg.block_size} conflicts with model {reg.model!r}, which uses {known}"
            )
        jetstream = reg.endpoint.startswith("jetstream:")
        if jetstream:
            check_jetstream_owner(reg)
        # A JetStream subject is one publisher whatever the topic (the topic is a ZeroMQ filter).
        keys = frozenset((k, "" if jetstream else reg.topic) for k in ep_keys)
        for k in keys:
            owner = self._owners.get(k)
            if owner is not None and owner != replacing:
                other = self._workers[owner]
                raise DuplicateWorker(
                    f"endpoint {reg.endpoint} (topic {reg.topic!r}) reaches the publisher already "
                    f"registered as {other.worker_id!r} ({other.reg.endpoint})"
                )
        return keys

    def remove(self, worker_id: str) -> RegisteredWorker:
        try:
            state = self._workers.pop(worker_id)
        except KeyError:
            raise UnknownWorker(f"worker {worker_id!r} is not registered") from None
        for k in state.keys:
            if self._owners.get(k) == worker_id:
                del self._owners[k]
        model = self._models[state.reg.model]
        model[1] -= 1
        if not model[1]:
            del self._models[state.reg.model]
        return state

    def get(self, worker_id: str) -> RegisteredWorker | None:
        return self._workers.get(worker_id)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def __len__(self) -> int:
        return len(self._workers)

    def __iter__(self) -> Iterator[RegisteredWorker]:
        return iter(list(self._workers.values()))

    def of_model(self, model: str) -> list[RegisteredWorker]:
        return [w for w in self._workers.values() if w.reg.model == model]

    def block_size_of(self, model: str) -> int | None:
        m = self._models.get(model)
        return m[0] if m else None

    def models(self) -> dict[str, int]:
        return {model: m[0] for model, m in self._models.items()}

    def watermarks(self) -> dict[str, int]:
        return {w.worker_id: w.last_seq for w in self._workers.values() if w.last_seq is not None}

    def degraded(self, now: float) -> dict[str, list[str]]:
        """`RegisteredWorker.degraded` of every worker with a reason (`GET /health`): the statuses in one
        pass (`status_columns`, in C with the native module), the reasons only for those few."""
        states = list(self._workers.values())
        out = {}
        for w, status in zip(states, status_columns(states, now, self.policy)[0]):
            if status in ("stale", "resyncing") or not w.clean or w.dropping(now):
                out[w.worker_id] = w.degraded(now, self.policy)
        return out

    def statuses(self, now: float, workers: Iterable[RegisteredWorker] | None = None) -> dict[str, str]:
        return {w.worker_id: w.status(now, self.policy) for w in (workers or self._workers.values())}
