"""Embedded mode: a Python router subscribes to its workers' KV event streams and scores queries in
its own process — no HTTP, no second service (docs/service.md, "Embedded mode").

    from router_api.embedded import EmbeddedIndexer

    with EmbeddedIndexer(workers=[{"worker_id": "w0", "endpoint": "tcp://10.0.0.5:5557",
                                   "replay_endpoint": "tcp://10.0.0.5:5558"}], block_size=16) as idx:
        res = idx.score(token_ids)          # schemas.api.ScoreResponse, best worker first
        target = res.best                   # BestWorker(worker_id, dp_rank) or None

It is the `kvatlas indexer` service minus the HTTP app: the same `IndexerService` (ingest thread,
reconciliation policy, registry, liveness, metrics, optional snapshots), so an embedded index and
a served one apply the same stream to the same state. It lives in `router_api` because it reuses
that service; importing it loads neither FastAPI nor uvicorn.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Mapping, Sequence

import msgspec

from router_api import score_text
from indexer.pending import DEFAULT_TTL_S, PendingRoutes
from router_api.config import ServiceConfig
from router_api.score_plan import answer_limit
from router_api.service import IndexerService
from schemas.api import QueryResponse, RegisterWorker, RouteAnswer, ScoreResponse, WorkersResponse, WorkerStatus

WorkerSpec = RegisterWorker | Mapping[str, Any]


class EmbeddedIndexer:
    """The indexer inside the caller's process. `workers`: registrations (RegisterWorker or dicts of
    its fields; `model` / `block_size` default to this indexer's); `**config`: any further
    `ServiceConfig` keyword (e.g. `stale_after_s`, `tier_weights`, `snapshot_target`).
    `start()` subscribes (returns self), `close()` stops the ingest thread; `score` / `query` may be
    called from any thread, before `start()` too (they then see an empty index)."""

    __slots__ = ("service", "model", "_closed")

    def __init__(self, workers: Iterable[WorkerSpec] = (), *, block_size: int = 16, model: str = "default",
                 pending_ttl_s: float = DEFAULT_TTL_S, **config: Any) -> None:
        regs = [self._reg(w, model, block_size) for w in workers]
        self.model = model
        self.service = IndexerService(ServiceConfig(model=model, block_size=block_size, static_workers=regs,
                                                    **config),
                                      pending=PendingRoutes(ttl_s=pending_ttl_s))
        self.service.index.ensure_model(model, block_size)  # scoring before start() sees an empty index
        self._closed = False

    @staticmethod
    def _reg(spec: WorkerSpec, model: str, block_size: int) -> RegisterWorker:
        if isinstance(spec, RegisterWorker):
            return spec
        fields = {"model": model, "block_size": block_size, **spec}
        try:
            return msgspec.convert(fields, RegisterWorker)
        except msgspec.ValidationError as exc:
            raise ValueError(f"bad worker registration {dict(spec)!r}: {exc}") from None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "EmbeddedIndexer":
        self.service.start()
        return self

    def close(self, final_snapshot: bool = True) -> None:
        """Stop ingestion (idempotent); with a snapshot target, write a last snapshot first."""
        if not self._closed:
            self._closed = True
            self.service.stop(final_snapshot=final_snapshot)

    def __enter__(self) -> "EmbeddedIndexer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- queries -----------------------------------------------------------------------------
    def score(self, token_ids: Sequence[int] | Any = None, *, model: str | None = None, lora_name: str | None = None,
              cache_salt: str | None = None, prompt: str | None = None,
              messages: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
              add_special_tokens: bool | None = None, answer: str | None = None,
              top_k: int | None = None) -> ScoreResponse:
        """Every registered worker's prefix match, best first: exactly the body `POST /score`
        answers, `answer` ("full" | "holders") and `top_k` as there (docs/reference.md, "The holders'
        answer": unset, full up to AUTO_HOLDERS_PAST registered pairs, else only the holders' rows). Exactly one input: `token_ids` (a list of ints or an integer numpy array, a u32
        array is the fastest), `prompt` (completions text) or `messages` (chat), the last two
        tokenized with the model's tokenizer (`tokenizers={model: directory}` at construction);
        a text query answers a `TextScoreResponse` (`prompt_tokens` added).
        Raises `router_api.service.UnknownModel` for a model no worker is registered for and
        `router_api.score_text.TextInputError` for text it cannot tokenize (or no tokenizer)."""
        m = model or self.model
        limit = None if answer is None and top_k is None else answer_limit(answer, top_k, 0)
        if not score_text.is_text(token_ids, prompt, messages):
            return self.service.score(m, token_ids, lora_name, cache_salt, limit)
        ids = score_text.text_tokens(self.service.config.tokenizers, m, prompt, messages,
                                     add_generation_prompt=add_generation_prompt,
                                     add_special_tokens=add_special_tokens)
        return score_text.text_response(self.service.score(m, ids, lora_name, cache_salt, limit), len(ids))

    def query(self, token_ids: Sequence[int] | Any, *, model: str | None = None, lora_name: str | None = None,
              cache_salt: str | None = None) -> QueryResponse:
        """The Dynamo / Mooncake-RFC shape `POST /query` answers (matched tokens per worker)."""
        return self.service.query_compat(model or self.model, token_ids, lora_name, cache_salt)

    def wait_live(self, timeout_s: float = 30.0, poll_s: float = 0.05) -> WorkersResponse:
        """Block until every registered worker is `live` (its stream subscribed and caught up);
        TimeoutError naming the others and their status at the deadline. For a router that must not
        route on an index still filling up after `start()`."""
        deadline = time.monotonic() + timeout_s
        while True:
            rows = self.workers()
            waiting = [(w.worker_id, w.status) for w in rows.workers if w.status != "live"]
            if not waiting:
                return rows
            if time.monotonic() >= deadline:
                raise TimeoutError(f"workers not live after {timeout_s}s: "
                                   + ", ".join(f"{w} ({st})" for w, st in waiting))
            time.sleep(poll_s)  # readiness poll against the deadline

    # -- in-flight routes --------------------------------------------------------------------
    def report_route(self, model: str | None, request_id: str, worker_id: str, token_ids: Sequence[int] | Any,
                     dp_rank: int = 0, lora_name: str | None = None, cache_salt: str | None = None,
                     busy_until: float | None = None) -> int:
        """The router chose `worker_id` for this request (like `POST /routes`): its full blocks count
        as `pending_blocks` there until the worker's events cover them, `release_route`, or the TTL.
        Returns `pending_blocks`: the request's leading blocks past the worker's exact match that earlier
        routes there hold (what `/score` showed for it, at this instant). Raises UnknownModel /
        `router_api.routes.UnknownRouteWorker`."""
        return self.service.report_route(model or self.model, request_id, worker_id, token_ids, dp_rank,
                                         lora_name, cache_salt, busy_until).pending_blocks

    def release_route(self, model: str | None, request_id: str) -> int:
        """The request finished or failed (like `DELETE /routes/{id}`); idempotent, unknown id: 0."""
        return self.service.release_route(model or self.model, request_id)

    def route(self, model: str | None, request_id: str, worker_id: str, token_ids: Sequence[int] | Any,
              dp_rank: int = 0, lora_name: str | None = None, cache_salt: str | None = None,
              busy_until: float | None = None, admits: bool = True) -> RouteAnswer:
        """`report_route` answering in full (like `POST /routes`): `cached_blocks`, `pending_blocks`
        and, with `admits` (the router calls `admit_route` when the worker accepts the request),
        `after`: the routes to forward it after (`wait_routes`; docs/CONTRACTS.md, "Pending routes")."""
        return self.service.report_route(model or self.model, request_id, worker_id, token_ids, dp_rank,
                                         lora_name, cache_salt, busy_until, admits)

    def admit_route(self, model: str | None, request_id: str) -> bool:
        """The worker accepted the request into its queue (like `POST /routes/admitted`)."""
        return self.service.admit_route(model or self.model, request_id)

    def wait_routes(self, model: str | None, request_ids: Sequence[str], timeout_s: float = 2.0) -> list[str]:
        """Block until one of the routes no longer awaits admission, or the timeout (like
        `POST /routes/wait`); returns those still awaiting (all of them: it timed out, counted)."""
        return self.service.wait_routes(model or self.model, request_ids, timeout_s)

    # -- membership --------------------------------------------------------------------------
    def add_worker(self, worker: WorkerSpec) -> WorkerStatus:
        """Register and subscribe (like `POST /workers`); `RegistryError` subclasses on refusal."""
        return self.service.register(self._reg(worker, self.model, self.service.config.block_size))

    def remove_worker(self, worker_id: str) -> None:
        self.service.unregister(worker_id)

    def workers(self) -> WorkersResponse:
        return self.service.workers()
