"""The indexer service: wires the KVIndex, the ingestion thread, the worker registry, metrics and
snapshots together, and offers the operations the HTTP app exposes. start()/stop() own every
thread; nothing here is global, so tests can run several services in one process. Its configuration is
router_api/config.py, its snapshots router_api/service_snapshot.py, what `score` keeps of the registry
router_api/score_plan.py.

`ingest_shards` N > 1: a worker-sharded index and N ingest pipelines (`router_api.ingest.IngestSet`),
each with its own thread, subscriber and shard lock; `self.lock` is then a `ShardedLock`, and every
`with self.lock` below still excludes all ingestion (router_api/locks.py).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable

import msgspec

from indexer.snapshot import Snapshot, SnapshotStore, make_snapshot_store
from indexer.core import native as native_core
from router_api import answer, service_snapshot
from router_api.config import TIER_KEYS, ServiceConfig, check_ingest_shards, default_index, default_subscriber
from router_api.ingest import IngestLoop, IngestSet
from router_api.locks import ShardedLock
from router_api.metrics import ServiceMetrics
from router_api.score_plan import Query, ScorePlan, ScoreRows, pending_columns, query_response, score_rows
from router_api.worker_metrics import WorkerGauges
from router_api.routes import RouteBook, RouteTimer, UnknownRouteWorker
from indexer.pending import PendingRoutes
from indexer.protocol import Index, ScoringIndex, Subscriber
from indexer.reconcile import LivenessPolicy, status_columns
from router_api.registry import (
    ConflictingBlockSize,
    Registry,
    RegistryError,
    RegistryFull,
    SubscribeFailed,
    UnknownWorker,
)
from schemas.api import (
    AUTO_HOLDERS_PAST,
    HealthResponse,
    QueryResponse,
    RegisterWorker,
    RouteAnswer,
    ScoreResponse,
    WorkerScoreOut,
    WorkersResponse,
    WorkerStatus,
)

log = logging.getLogger("kvatlas.service")
_json = msgspec.json.Encoder()
_msgpack = msgspec.msgpack.Encoder()


class ServiceHealth(HealthResponse):
    """`GET /health`: the shared HealthResponse plus which index core serves (docs/service.md)."""

    core: str = "python"
    # Workers whose rows are not to be trusted now, with why (RegisteredWorker.degraded); any: `status` degraded.
    degraded_workers: dict[str, list[str]] = msgspec.field(default_factory=dict)


def core_name(index: Index) -> str:
    """"native" when the index runs on the C accelerator, else "python"."""
    return "native" if index.native else "python"


class UnknownModel(Exception):
    """Scored a model no worker is registered for (HTTP 404)."""


class IndexerService:
    def __init__(
        self,
        config: ServiceConfig,
        *,
        index: ScoringIndex | None = None,
        subscriber_factory: Callable[[], Subscriber] | None = None,
        snapshot_store: SnapshotStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        pending: PendingRoutes | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        shards = config.ingest_shards
        check_ingest_shards(shards, config.trust_engine_hashes)  # the config's fields may be set after it was made
        self.index: ScoringIndex = index if index is not None else default_index(config)
        if shards > 1 and self.index.shard_count != shards:
            raise ValueError(f"ingest_shards={shards} needs an index of {shards} worker shards "
                             f"(indexer.sharded.ShardedIndex), got {type(self.index).__name__}")
        self.registry = Registry(LivenessPolicy(
            stale_after_s=config.stale_after_s, remove_after_s=config.remove_after_s,
            silent_engine_factor=config.silent_engine_factor, resync_hold_s=config.resync_hold_s,
        ), max_workers=config.max_workers)
        self.metrics = ServiceMetrics()
        self.worker_gauges = WorkerGauges()  # per-worker status / silence / refusals (router_api/worker_metrics.py)
        # In-flight routes routers report (`report_route`); `/score` rows' pending_blocks (router_api/routes.py).
        self.routes = RouteBook(pending, self.metrics.visibility)
        self.core = core_name(self.index)
        self.metrics.index_core.set(self.core, value=1.0)
        self.store = snapshot_store if snapshot_store is not None else make_snapshot_store(
            config.snapshot_target, key=config.snapshot_key)
        factory = subscriber_factory or default_subscriber(config)
        # Guards the index and the registry together; every `with self.lock` here is exclusive (with
        # ingest shards: all the shards' locks, router_api/locks.py).
        self.lock: threading.Lock | ShardedLock
        self.ingest: IngestLoop | IngestSet
        if shards == 1:
            self.lock = threading.Lock()
            self.ingest = IngestLoop(
                index=self.index, registry=self.registry, lock=self.lock, metrics=self.metrics,
                subscriber_factory=factory,
                on_expired=self._expire, on_subscribe_failed=self._subscribe_failed, poll_ms=config.poll_ms,
                clock=clock,
            )
        else:
            # One pipeline per index shard: its own thread, subscriber (`factory` is called once per
            # loop, on its thread) and lock; loop 0 alone runs the policy tick.
            self.lock = ShardedLock(shards)
            self.ingest = IngestSet([
                IngestLoop(
                    index=self.index, registry=self.registry, lock=self.lock.shard(i), global_lock=self.lock,
                    metrics=self.metrics, subscriber_factory=factory, on_expired=self._expire,
                    on_subscribe_failed=self._subscribe_failed, poll_ms=config.poll_ms, clock=clock,
                    ticks=i == 0, name=f"kvatlas-ingest-{i}",
                ) for i in range(shards)
            ], self.index.shard_of)
        self.generation = 0
        self.started_at = clock()
        self.restored_from: int | None = None  # generation of the snapshot we started from
        self._snap_stop = threading.Event()
        self._snap_thread: threading.Thread | None = None
        self._snap_lock = threading.Lock()  # one snapshot write at a time
        self._route_timer: RouteTimer | None = None
        self._started = False
        self._running = False  # start() completed: only then may stop() write a final snapshot
        self._blocks_cache: tuple[float, dict[tuple[str, int], dict[str, int]]] | None = None
        self._membership = 0  # bumped on (un)registration: a snapshot with nothing new is skipped
        self._saved_mark: tuple[int, int] | None = None
        self.plane: Any = None  # router_api.nats_plane.NatsPlane under `kvatlas indexer --nats` (docs/jetstream.md)
        self.route_fanout: Any = None  # router_api.route_plane.RouteFanout under `--nats`: routes reach every replica
        self._plans: dict[str, ScorePlan] = {}  # per model, see _plan
        self._plan_epoch = 0  # bumped under the lock with each registry membership change (_plan's check)
        # The C answer writer (`score_answer`): with the native module and the schema it writes (the
        # index packs rows for it, `score_table`, where it can).
        mod = native_core.select(None)
        self._writer = mod if answer.SUPPORTED and hasattr(mod, "write_answer") else None
        self._formats = answer.Formats()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._started:
            raise RuntimeError("service already started")
        self._started = True
        self.index.ensure_model(self.config.model, self.config.block_size)
        self._restore()
        for reg in self.config.static_workers:
            if reg.worker_id in self.registry:
                continue  # already restored from the snapshot, with its watermark
            try:
                self.register(reg)
            except RegistryError as exc:
                log.error("event=static_worker_rejected worker=%s error=%s", reg.worker_id, exc)
        self.ingest.start()
        self._running = True
        self._route_timer = RouteTimer(self.routes, self.lock, self.index, self.registry, self.clock)
        self._route_timer.start()  # route expiry and admission deadlines run without traffic
        if self.store is not None:
            self._snap_thread = threading.Thread(target=self._snapshot_loop, name="kvatlas-snapshot",
                                                 daemon=True)
            self._snap_thread.start()
        log.info("event=service_started model=%s block_size=%d workers=%d snapshot=%s auth=%s%s",
                 self.config.model, self.config.block_size, len(self.registry),
                 self.store.description if self.store else "none",
                 "on" if self.config.auth_token else "off",
                 f" ingest_shards={self.config.ingest_shards}" if self.config.ingest_shards > 1 else "")

    def stop(self, final_snapshot: bool = True) -> None:
        self._snap_stop.set()
        if self._route_timer is not None:
            self._route_timer.stop()
        if self._snap_thread is not None:
            self._snap_thread.join(30)
        self.ingest.stop()
        if final_snapshot and self._running and self.store is not None:
            self.snapshot_now()
        if self.store is not None:
            self.store.close()
        log.info("event=service_stopped")

    # -- registration ------------------------------------------------------------------------
    def register(self, reg: RegisterWorker, last_seq: int | None = None) -> WorkerStatus:
        with self.lock:
            known = self.index.models()
            if reg.model not in known and len(known) >= self.config.max_models:
                self.worker_gauges.refuse(reg.worker_id, "registryfull")
                raise RegistryFull(f"{len(known)} models indexed: the limit (max_models) is "
                                   f"{self.config.max_models}; a model goes when its last worker does")
            try:
                self.registry.add(reg, self.clock(), model_block_sizes=known, last_seq=last_seq)
            except RegistryError as exc:
                self.worker_gauges.refuse(reg.worker_id, "block_size_conflict" if isinstance(exc, ConflictingBlockSize)
                                          else type(exc).__name__.lower())
                raise
            self._plan_epoch += 1
            try:
                self.index.ensure_model(reg.model, reg.block_size)
            except Exception as exc:  # BlockSizeConflict: keep registry and index consistent
                self.registry.remove(reg.worker_id)
                self.worker_gauges.refuse(reg.worker_id, "block_size_conflict")
                raise ConflictingBlockSize(str(exc)) from exc
            # Known to the index before its first event, so /score lists it from the start.
            self.index.register_worker(reg.model, reg.worker_id, reg.dp_rank)
            status = self._status_of(reg.worker_id, self.clock())
        self._membership += 1
        sub = self.ingest.subscribe(reg, last_seq)
        if self.ingest.alive and not self.ingest.owns(threading.current_thread()):
            # Answer only once the subscription exists: a failed one is undone, never a 201.
            error = sub.wait(self.config.subscribe_timeout_s)
            if error is not None:
                if not sub.is_set():  # timed out: undo here (the thread may still subscribe later)
                    self._subscribe_failed(reg.worker_id, error, reg)
                    self.ingest.unsubscribe(reg.worker_id)
                raise SubscribeFailed(f"cannot subscribe to {reg.endpoint} for worker {reg.worker_id!r}: {error}")
        log.info("event=registered worker=%s model=%s block_size=%d endpoint=%s replay=%s dp_rank=%d",
                 reg.worker_id, reg.model, reg.block_size, reg.endpoint, reg.replay_endpoint, reg.dp_rank)
        return status

    def check_replacement(self, reg: RegisterWorker) -> None:
        """Raise the RegistryError that unregistering `reg.worker_id` and registering `reg` would
        end in, changing nothing (the shared registry checks a changed entry before it removes
        the live worker)."""
        with self.lock:
            known = dict(self.index.models())
            others = [w for w in self.registry.of_model(reg.model) if w.worker_id != reg.worker_id]
            if not others and reg.model != self.config.model:
                known.pop(reg.model, None)  # the model goes with its last worker (_drop_model_if_unused)
            self.registry.check(reg, known, replacing=reg.worker_id)

    def unregister(self, worker_id: str, reason: str = "request") -> None:
        with self.lock:
            state = self.registry.remove(worker_id)
            self._plan_epoch += 1
            self.index.remove_worker(state.reg.model, worker_id)
            self.routes.forget_worker(state.reg.model, worker_id)
            self._drop_model_if_unused(state.reg.model)
        self._membership += 1
        self.ingest.unsubscribe(worker_id)
        self.metrics.forget_worker(worker_id)
        log.info("event=unregistered worker=%s reason=%s", worker_id, reason)

    def _subscribe_failed(self, worker_id: str, error: str, reg: RegisterWorker | None = None) -> None:
        """Undo a registration whose subscription failed (called by the ingest thread, or by
        `register` on a timeout): the registry and index forget it; nothing was subscribed."""
        with self.lock:
            state = self.registry.get(worker_id)
            if state is None or (reg is not None and state.reg is not reg):
                return
            self.registry.remove(worker_id)
            self._plan_epoch += 1
            self.index.remove_worker(state.reg.model, worker_id)
            self._drop_model_if_unused(state.reg.model)
        self._membership += 1
        log.error("event=registration_undone worker=%s reason=subscribe_failed error=%s", worker_id, error)

    def _drop_model_if_unused(self, model: str) -> None:
        """A model no registered worker serves is dropped (its block size with it), except the
        configured one. Call under the lock."""
        if model == self.config.model or self.registry.block_size_of(model) is not None:
            return
        if self.index.drop_model(model):
            self.routes.forget_model(model)
            self._plans.pop(model, None)
            log.info("event=model_dropped model=%s reason=no_workers", model)

    def _expire(self, worker_id: str) -> None:
        try:
            self.unregister(worker_id, reason="expired")
        except UnknownWorker:
            pass

    # -- queries -----------------------------------------------------------------------------
    def _status_of(self, worker_id: str, now: float, blocks: dict[tuple[str, int], dict[str, int]] | None = None
                   ) -> WorkerStatus:
        w = self.registry.get(worker_id)
        if w is None:
            raise UnknownWorker(f"worker {worker_id!r} is not registered")
        return w.row(now, self.registry.policy, blocks)

    def worker(self, worker_id: str) -> WorkerStatus:
        """`GET /workers/{id}`: one row of `workers()` (UnknownWorker when it is not registered; a
        `kvatlas worker` asks it to notice an indexer that forgot it, sim/registrar.py)."""
        stats = self._block_stats(self.clock())
        with self.lock:
            return self._status_of(worker_id, self.clock(), stats)

    def _block_stats(self, now: float) -> dict[tuple[str, int], dict[str, int]]:
        """Blocks per (worker, rank) and tier, counted at most once per `stats_ttl_s`."""
        cached = self._blocks_cache
        if cached is not None and now - cached[0] < self.config.stats_ttl_s:
            return cached[1]
        stats: dict[tuple[str, int], dict[str, int]] = {}
        with self.lock:
            models = {w.reg.model for w in self.registry}
        for model in models:  # one model at a time: ingestion waits for one model's count only
            with self.lock:
                if model in self.index.models():
                    stats.update(self.index.worker_stats(model))
        self._blocks_cache = (now, stats)
        return stats

    def workers(self) -> WorkersResponse:
        now = self.clock()
        stats = self._block_stats(now)
        with self.lock:
            rows = [self._status_of(w.worker_id, now, stats) for w in self.registry]
        rows.sort(key=lambda s: s.worker_id)
        gauge: dict[tuple[str, ...], float] = {}
        for s in rows:
            for k in TIER_KEYS:
                gauge[(s.worker_id, k)] = getattr(s.blocks, k)
        self.metrics.worker_blocks.replace(gauge)
        return WorkersResponse(workers=rows)

    def _plan(self, model: str) -> "ScorePlan":
        """The model's registered (worker, rank) pairs, rebuilt only when membership or a worker's
        ranks changed (ranks only grow while a worker is registered). Call under the lock.
        Membership is checked by an epoch every registry change under the lock bumps (and the
        registry's size, for a registry changed from outside the service), ranks by the version every
        new rank of any worker moves (`Registry.add_rank`): no pass over the registry or the ranks."""
        key = (self._plan_epoch, len(self.registry), self.registry.ranks_version)
        plan = self._plans.get(model)
        if plan is None or plan.key != key:
            states = self.registry.of_model(model)
            plan = self._plans[model] = ScorePlan(states, key)
        return plan

    def _scope(self, model: str) -> tuple[int, ScorePlan]:
        """Under the lock: the model's block size and registered pairs (UnknownModel if the index lacks it)."""
        block_size = self.index.block_size(model)
        if block_size is None:
            raise UnknownModel(f"unknown model {model!r}")
        return block_size, self._plan(model)

    def score(self, model: str, token_ids: Any, lora_name: str | None = None,
              cache_salt: str | None = None, limit: int | None = None) -> ScoreResponse:
        """`limit` (score_plan.answer_limit): -1 the full answer, 0 the holders' answer, K its first K
        rows; None: full up to AUTO_HOLDERS_PAST registered pairs, else holders."""
        now = self.clock()
        with self.lock:
            block_size, plan = self._scope(model)
            lim = limit if limit is not None else -1 if len(plan.pairs) <= AUTO_HOLDERS_PAST else 0
            rows = self._score_rows(model, block_size, plan, Query(token_ids, lora_name, cache_salt), now, lim >= 0)
        return rows.response(lim)

    def score_answer(self, model: str, token_ids: Any, lora_name: str | None = None, cache_salt: str | None = None,
                     msgpack: bool = False, limit: int | None = None) -> bytes:
        """`score`, encoded: exactly `msgspec.{json,msgpack}.encode(self.score(...))`, from one lookup of the
        model and its registered pairs. With the native core the rows never become objects: the index packs
        them and C writes the bytes (router_api/answer.py); what that path does not take (pure core, a hybrid
        model's rows with routes pending, odd tokens or scores) becomes `score`'s rows, encoded by msgspec."""
        now = self.clock()
        with self.lock:
            block_size, plan = self._scope(model)
            lim = limit if limit is not None else -1 if len(plan.pairs) <= AUTO_HOLDERS_PAST else 0
            out = None if self._writer is None else self._write_answer(
                model, block_size, plan, token_ids, lora_name, cache_salt, now, msgpack, lim)
            if out is None:
                rows = self._score_rows(model, block_size, plan, Query(token_ids, lora_name, cache_salt), now,
                                        lim >= 0)
        if out is not None:
            self.metrics.score_answers.inc("c")
            return out
        self.metrics.score_answers.inc("msgspec")
        return (_msgpack if msgpack else _json).encode(rows.response(lim))

    def _score_rows(self, model: str, block_size: int, plan: ScorePlan, query: Query, now: float,
                    holders: bool = False) -> ScoreRows:
        """The rows of every registered pair (under the lock), in the index's order, split fresh / stale;
        `holders`: at least those that hold something or have routes in flight (`ScoreRows.response`
        with a limit >= 0 keeps only those): only those while no route is in flight."""
        holders = holders and not self.routes.pending.active(model)
        result = self.index.score(model, query.token_ids, lora_name=query.lora_name, cache_salt=query.cache_salt,
                                  workers=plan.scope(self.index.workers(model)), holders=holders)
        rows = score_rows(model, block_size, result, plan, now, self.registry.policy, holders)
        if self.routes.pending.active(model):
            try:
                self._add_pending(model, block_size, query, rows.fresh, rows.stale, now)
            except Exception as exc:  # pending state must never cost the exact answer
                self.metrics.drops.inc("pending_error")
                log.error("event=pending_rows_failed model=%s error=%r", model, exc)
        return rows

    def _write_answer(self, model: str, block_size: int, plan: ScorePlan, token_ids: Any, lora_name: str | None,
                      cache_salt: str | None, now: float, msgpack: bool, limit: int = -1) -> bytes | None:
        """The answer bytes by the C writer (under the lock), or None for what it does not take. `limit`:
        the answer's form (score_plan.answer_limit)."""
        index, writer = self.index, self._writer
        if writer is None:
            return None
        table = None
        holders = limit >= 0
        if plan.rows is not None:
            # The last query found the index holding exactly the plan's pairs; while the index keeps the
            # same order list (its membership unchanged), it still does: no membership check needed.
            table = index.score_table(model, token_ids, lora_name, cache_salt, None, holders)
            if table is not None and table.worker_ids is not plan.rows.worker_ids:
                table = None
            workers = None
        if table is None:
            workers = plan.scope(index.workers(model))
            table = index.score_table(model, token_ids, lora_name, cache_salt, workers, holders)
        if table is None or (table.kv is not None and self.routes.pending.active(model)):
            return None  # (a hybrid model's in-flight rows: the Python path, with its ends-only pending runs)
        rows = plan.answer_rows(table, workers is None)
        fmt = self._formats
        i = 1 if msgpack else 0
        pend: tuple[Any, ...] = ()
        if self.routes.pending.active(model):
            got = self._pending_columns(model, block_size, Query(token_ids, lora_name, cache_salt), rows.pairs,
                                        table.rows, now)
            if got is None:
                return None
            pend = got
        return writer.write_answer(
            msgpack, (fmt.holder_layouts if holders else fmt.layouts)[i], fmt.prefix(msgpack, model, block_size, holders),
            table.query_blocks, table.rows, rows.heads[i], rows.wix,
            *status_columns(plan.states, now, self.registry.policy), fmt.statuses[i], *(pend or (None, None)),
            table.kv, len(table.worker_ids), limit)

    def _pending_columns(self, model: str, block_size: int, query: Query,
                         pairs: list[tuple[str, int]], packed: bytes, now: float) -> tuple[Any, ...] | None:
        """`_add_pending` for the C writer (under the lock): the in-flight columns, () for none."""
        try:
            return pending_columns(self.routes, self.index, self.registry, model, block_size, query, now, pairs, packed)
        except Exception as exc:  # pending state must never cost the exact answer
            self.metrics.drops.inc("pending_error")
            log.error("event=pending_rows_failed model=%s error=%r", model, exc)
            return ()

    def _add_pending(self, model: str, block_size: int, query: Query, fresh: list[WorkerScoreOut],
                     stale: list[WorkerScoreOut], now: float) -> None:
        """Rows' `pending_blocks` (under the lock): the query's leading blocks past each row's exact
        match that routes reported to that worker still hold (docs/CONTRACTS.md, "Pending routes")."""
        book = self.routes
        book.sweep(self.index, self.registry, model, now)
        if not book.pending.active(model):
            return
        keys = book.keys(self.index, model, block_size, query.token_ids, query.lora_name, query.cache_salt)
        for rows in (fresh, stale):
            for row in rows:
                # kv_blocks is set exactly on a hybrid model's rows (docs/hybrid.md)
                row.pending_blocks = book.pending_run(model, row.worker_id, row.dp_rank, keys, row.cached_blocks,
                                                      hybrid=row.kv_blocks is not None)
                row.pending_requests, row.pending_prefill_tokens, row.busy_until = book.load(
                    model, row.worker_id, row.dp_rank, now)

    # -- in-flight routes --------------------------------------------------------------------
    def report_route(self, model: str, request_id: str, worker_id: str, token_ids: Any, dp_rank: int = 0,
                     lora_name: str | None = None, cache_salt: str | None = None,
                     busy_until: float | None = None, admits: bool = False) -> RouteAnswer:
        """A router chose `worker_id` for this request: its full blocks count as pending there until
        the worker's events cover them, `release_route`, or the TTL. Answers what the worker will
        serve from cache as the index sees it now (schemas.api.RouteAnswer); with `admits` (the router
        will report the worker's admission, `admit_route`) also the routes to forward it after.
        Raises UnknownModel / UnknownRouteWorker."""
        with self.lock:
            block_size = self.index.models().get(model)
        if block_size is None:
            raise UnknownModel(f"unknown model {model!r}")
        keys = self.routes.keys(self.index, model, block_size, token_ids, lora_name, cache_salt)
        with self.lock:
            cached, pend, n, after = self.routes.report(self.index, self.registry, model, request_id, worker_id,
                                                        dp_rank, keys, self.clock(), block_size, len(token_ids),
                                                        busy_until, admits)
        if self.route_fanout is not None:
            self.route_fanout.added(model, request_id, worker_id, dp_rank, keys, len(token_ids), busy_until, admits)
        return RouteAnswer(request_id, pend, cached, n, after)

    def apply_route(self, model: str, request_id: str, worker_id: str, dp_rank: int, keys: list[int],
                    tokens: int | None = None, busy_until: float | None = None, admits: bool = False) -> bool:
        """A route another indexer replica took (already hashed; `tokens`: the prompt's length, None from
        a replica that does not send it); False if the worker or model is unknown here."""
        with self.lock:
            block_size = self.index.models().get(model)
            if block_size is None:
                return False
            try:
                self.routes.report(self.index, self.registry, model, request_id, worker_id, dp_rank, keys,
                                   self.clock(), block_size, tokens, busy_until, admits)
            except UnknownRouteWorker:
                return False
        return True

    def release_route(self, model: str, request_id: str, fanout: bool = True) -> int:
        """The request finished or failed: forget its route (idempotent; unknown id: 0)."""
        with self.lock:
            n = self.routes.release(model, request_id, self.clock())
        if fanout and self.route_fanout is not None:
            self.route_fanout.released(model, request_id)
        return n

    def admit_route(self, model: str, request_id: str, fanout: bool = True) -> bool:
        """The worker accepted the route's request into its queue (causal forwarding): routes that
        wait for it may go. False: unknown, or not awaiting admission (idempotent)."""
        with self.lock:
            ok = self.routes.admit(model, request_id)
        if fanout and self.route_fanout is not None:
            self.route_fanout.admitted(model, request_id)
        return ok

    def watch_routes(self, model: str, request_ids: Sequence[str], wake: Callable[[], None]) -> int | None:
        """`wake()` once one of the routes no longer awaits admission (RouteBook.watch); None: one
        does not now."""
        with self.lock:
            return self.routes.watch(model, request_ids, wake, self.clock())

    def end_wait(self, model: str, request_ids: Sequence[str], token: int | None, seconds: float) -> list[str]:
        """A wait (`watch_routes`) is over: the routes still awaiting admission (all of them: it timed
        out), counted."""
        with self.lock:
            self.routes.unwatch(token)
            left = self.routes.awaiting(model, request_ids, self.clock())
            if token is not None:
                self.routes.waited(seconds, len(set(left)) == len(set(request_ids)))
        return left

    def wait_routes(self, model: str, request_ids: Sequence[str], timeout_s: float) -> list[str]:
        """Block until one of the routes no longer awaits admission or `timeout_s` passes (embedded
        routers; the HTTP endpoint waits on its event loop instead); returns those still awaiting."""
        done = threading.Event()
        t0 = time.monotonic()
        token = self.watch_routes(model, request_ids, done.set)
        if token is not None:
            done.wait(timeout_s)
        return self.end_wait(model, request_ids, token, time.monotonic() - t0)

    def query_compat(self, model: str, token_ids: Any, lora_name: str | None,
                     cache_salt: str | None) -> QueryResponse:
        """Dynamo / Mooncake-RFC shape, in tokens; per worker the best dp rank's tiers (every worker)."""
        return query_response(self.score(model, token_ids, lora_name, cache_salt, -1))

    def dump(self) -> dict[str, Any]:
        with self.lock:
            models = self.index.models()
            out = {
                m: {"block_size": bs, "workers": [
                    {"worker_id": wid, "dp_rank": rank, "events": events}
                    for wid, rank, events in self.index.dump(m)
                ]} for m, bs in models.items()
            }
            marks = self.registry.watermarks()
        return {"generation": self.generation, "models": out, "watermarks": marks}

    def health(self) -> ServiceHealth:
        # Without the index lock: /health answers on the event loop while an ingest pipeline holds the
        # lock for a chunk (a hostile publisher's large batches). Each read is one step under the GIL.
        n = len(self.registry)
        models = dict(self.index.models())
        alive = self.ingest.alive
        now = self.clock()
        degraded = self.registry.degraded(now)
        return ServiceHealth(status="ok" if alive and not degraded else "degraded", workers=n, ingest_alive=alive,
                             uptime_s=now - self.started_at, models=models, core=self.core,
                             degraded_workers=degraded)

    def stats(self) -> dict[str, Any]:
        """Numbers the dashboard polls; rates are computed client-side from these totals."""
        with self.lock:
            pending = self.routes.stats()
        return {
            "uptime_s": self.clock() - self.started_at,
            **self.metrics.totals(),
            "ingest_shards": self.config.ingest_shards,  # pipelines in use (the CLI's `auto` resolved)
            "snapshot_generation": self.generation,
            "core": self.core,  # native | python (the dashboard's "core" card)
            "pending": pending,
            "workers": self.workers().workers,
        }

    def metrics_text(self) -> str:
        self.worker_gauges.update(self.workers().workers)  # refresh per-worker block / status gauges
        for reason, n in native_core.declines().items():
            self.metrics.native_declines.set(reason, value=float(n))
        with self.lock:
            pending = self.routes.metrics_text()
        fan = "" if self.route_fanout is None else self.route_fanout.metrics_text()
        return (self.metrics.render() + self.worker_gauges.render() + pending + fan
                + ("" if self.plane is None else self.plane.metrics_text()))

    # -- snapshots (router_api/service_snapshot.py) -----------------------------------------
    def build_snapshot(self) -> Snapshot:
        return service_snapshot.build_snapshot(self)

    def snapshot_now(self, only_if_changed: bool = False) -> bool:
        return service_snapshot.snapshot_now(self, only_if_changed)

    def _snapshot_loop(self) -> None:
        while not self._snap_stop.wait(self.config.snapshot_interval_s):
            self.snapshot_now(only_if_changed=True)

    def _load_snapshot_bytes(self) -> bytes | None:
        return service_snapshot.load_snapshot_bytes(self)

    def _restore(self) -> None:
        service_snapshot.restore(self)
