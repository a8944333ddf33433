"""HTTP API request/response types of the indexer service (msgspec, no logic, no torch).

The field names are the public contract: routers and tests depend on them. Requests are decoded
with msgspec straight from the raw body (JSON or msgpack), so large token lists never go through
pydantic. Token ids are u32; list lengths are bounded so absurd bodies fail validation (422).
"""
from __future__ import annotations

from typing import Annotated, Any, Final, Literal, Optional

import msgspec
from msgspec import Meta, Struct

U32_MAX: Final = (1 << 32) - 1
# An upper bound on query length: far above any real context, low enough to bound CPU per request.
MAX_QUERY_TOKENS: Final = 2_000_000

TokenId = Annotated[int, Meta(ge=0, le=U32_MAX)]
TokenList = Annotated[list[TokenId], Meta(max_length=MAX_QUERY_TOKENS)]
Name = Annotated[str, Meta(min_length=1, max_length=256)]
OptName = Optional[Annotated[str, Meta(max_length=256)]]

WORKER_STATUSES: Final = ("connecting", "live", "stale", "resyncing")

# The /score answer's form (docs/reference.md, "The holders' answer"): "full", a row per registered
# (worker, dp_rank); "holders", only the rows that hold some of the query or have routes in flight
# (`holders_only: true` in the answer). Unset: full up to AUTO_HOLDERS_PAST registered pairs, holders
# past it. `top_k`: the holders' answer cut to its first K rows.
AnswerForm = Literal["full", "holders"]
AUTO_HOLDERS_PAST: Final = 1024
TopK = Optional[Annotated[int, Meta(ge=1, le=1 << 24)]]


# --- registration ------------------------------------------------------------------------------

class RegisterWorker(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """`POST /workers` body; also what a snapshot stores per registered worker."""

    worker_id: Name
    endpoint: Annotated[str, Meta(min_length=1, max_length=512)]
    replay_endpoint: Optional[Annotated[str, Meta(min_length=1, max_length=512)]] = None
    model: Name = "default"
    block_size: Annotated[int, Meta(ge=1, le=1 << 20)] = 16
    dp_rank: Annotated[int, Meta(ge=0, le=1 << 16)] = 0
    topic: Annotated[str, Meta(max_length=256)] = ""
    # The worker's OpenAI-compatible HTTP base URL (http[s]://host:port[/path]): what a router sends
    # its requests to (GET /workers lists it). Optional: an engine registered without one is indexed
    # and scored all the same.
    url: Optional[Annotated[str, Meta(min_length=1, max_length=512)]] = None


# gc=False on the per-worker answer rows (no reference cycles are possible): a /score answer makes
# two per worker, and untracked objects neither cost GC bookkeeping nor trigger collections.
class TierBlocks(Struct, gc=False):
    gpu: int = 0
    host: int = 0
    disk: int = 0
    shared: int = 0


class WorkerStatus(Struct):
    """One row of `GET /workers`."""

    worker_id: str
    endpoint: str
    replay_endpoint: Optional[str]
    model: str
    block_size: int
    dp_rank: int
    topic: str
    status: str  # one of WORKER_STATUSES
    last_seq: Optional[int]
    lag: Optional[float]  # seconds between publish ts and our apply, last batch
    silent_s: Optional[float]  # seconds since the last message (None before the first)
    blocks: TierBlocks
    dp_ranks: list[int]
    batches: int
    gaps: int
    replays: int
    resyncs: int
    restarts: int
    # False from a loss the publisher has not answered with its full state (an AllBlocksCleared
    # batch) or a restart: rows may then differ from another replica's at the same last_seq.
    exact: bool = True
    url: Optional[str] = None  # RegisterWorker.url
    # Events of this worker the index dropped, by reason (indexer.core.types' vocabulary, `apply_error`,
    # the reconciliation's drops), since it registered; `dropping`: some were dropped within the last
    # DROPPING_WINDOW_S, so its rows may lack blocks it holds (docs/reference.md, "Workers").
    drops: dict[str, int] = msgspec.field(default_factory=dict)
    dropping: bool = False


# How long a drop keeps a worker `dropping` (WorkerStatus.dropping).
DROPPING_WINDOW_S: Final = 60.0


class WorkersResponse(Struct):
    workers: list[WorkerStatus]


# --- scoring -----------------------------------------------------------------------------------

# A chat message as the OpenAI API spells it ({"role": ..., "content": ...}; content may be a list
# of parts); the model's chat template judges the rest (router_api/tokenization.py).
ChatMessages = Annotated[list[dict[str, Any]], Meta(max_length=100_000)]
PromptText = Annotated[str, Meta(max_length=64 * 1024 * 1024)]


class ScoreRequest(Struct, omit_defaults=True):
    """Exactly one of `token_ids`, `prompt` (completions text) or `messages` (chat); the last two
    are tokenized with the model's tokenizer the way the engines' OpenAI servers do it."""

    token_ids: Optional[TokenList] = None
    model: Name = "default"
    lora_name: OptName = None
    cache_salt: OptName = None
    prompt: Optional[PromptText] = None
    messages: Optional[ChatMessages] = None
    # chat: append the assistant header (the engines' default); prompt / chat: add the
    # post-processor's special tokens (default: yes for a prompt, no for a chat, as the engines do)
    add_generation_prompt: bool = True
    add_special_tokens: Optional[bool] = None
    answer: Optional[AnswerForm] = None
    top_k: TopK = None


class ScoreRequestRaw(Struct, omit_defaults=True):
    """Twin of ScoreRequest with `token_ids` left undecoded, for the native u32 fast path; the other
    fields (and their limits) must stay identical to ScoreRequest's."""

    token_ids: msgspec.Raw
    model: Name = "default"
    lora_name: OptName = None
    cache_salt: OptName = None
    prompt: Optional[PromptText] = None
    messages: Optional[ChatMessages] = None
    add_generation_prompt: bool = True
    add_special_tokens: Optional[bool] = None
    answer: Optional[AnswerForm] = None
    top_k: TopK = None


class WorkerScoreOut(Struct, omit_defaults=True, gc=False):
    """One worker's row. For hybrid models (docs/hybrid.md) device_blocks / cached_blocks are the
    usable prefixes and `kv_blocks` the full-attention-only match; omitted for full-attention-only
    models (only `kv_blocks` has a default, so nothing else is ever omitted)."""

    worker_id: str
    dp_rank: int
    device_blocks: int
    cached_blocks: int
    tiers: TierBlocks
    score: float
    stale: bool
    last_seq: Optional[int]
    status: str
    kv_blocks: Optional[int] = None
    # Leading query blocks past this row's exact match that in-flight routes to this worker hold
    # (`POST /routes`; docs/CONTRACTS.md, "Pending routes"). Never part of the exact fields above.
    pending_blocks: int = 0
    # In-flight load on this worker and rank from every router's pending routes: how many routes, and the
    # prompt tokens they will prefill there (past what it held or had pending when each was reported).
    pending_requests: int = 0
    pending_prefill_tokens: int = 0
    # The largest end time routers reported with their routes to this worker and rank (`busy_until` of
    # `POST /routes`, on the routers' clock; kept for the pending TTL, not ended by the worker's events).
    busy_until: Optional[float] = None


class BestWorker(Struct, gc=False):
    worker_id: str
    dp_rank: int


class ScoreResponse(Struct, omit_defaults=True):
    model: str
    block_size: int
    query_blocks: int
    workers: list[WorkerScoreOut]
    best: Optional[BestWorker]
    # the holders' answer: `workers` holds only the rows that hold some of the query or have routes in
    # flight (cut to `top_k`); a registered pair not listed scores 0 with nothing in flight
    holders_only: bool = False


class TextScoreResponse(ScoreResponse, kw_only=True):
    """The `/score` answer to a `prompt` or `messages` request: ScoreResponse plus the number of
    tokens the text became."""

    prompt_tokens: int


class RouteReport(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """`POST /routes`: a router chose `worker_id` (and `dp_rank`) for request `request_id`."""

    request_id: Name
    worker_id: Name
    token_ids: TokenList
    model: Name = "default"
    dp_rank: Annotated[int, Meta(ge=0, le=1 << 16)] = 0
    lora_name: OptName = None
    cache_salt: OptName = None
    # the router's own estimate of when the worker is done with the work routed to it, this request
    # included, on a clock every router replica shares (seconds; the indexer only keeps the largest)
    busy_until: Optional[Annotated[float, Meta(ge=-1e12, le=1e12)]] = None
    # the router reports when the worker admits the request (`POST /routes/admitted`) and forwards
    # it only after the routes the answer's `after` names were admitted (causal forwarding)
    admits: bool = False


class RouteAnswer(Struct):
    """What the chosen worker will serve this request from cache, as the index sees it at the report
    (before this route is added): `cached_blocks` exactly held (any tier) + `pending_blocks` past them
    held by earlier in-flight routes to that worker; `blocks`: the request's full blocks now pending;
    `after` (reports with `admits`): the routes holding the last pending block counted whose admission
    by the worker is not reported yet: forward this request once one of them is (`POST /routes/wait`)."""

    request_id: str
    pending_blocks: int
    cached_blocks: int = 0
    blocks: int = 0
    after: list[str] = []


MAX_WAIT_ROUTES = 1024   # route ids one wait may name
MAX_WAIT_S = 30.0        # the longest one wait may block


class RouteAdmitted(Struct, forbid_unknown_fields=True):
    """`POST /routes/admitted`: the worker accepted request `request_id` into its queue."""

    request_id: Name
    model: Name = "default"


class RouteWait(Struct, forbid_unknown_fields=True):
    """`POST /routes/wait`: answer once one of the routes no longer awaits admission (admitted or gone;
    at once if one does not await now), or after `timeout_s`."""

    request_ids: Annotated[list[Name], Meta(max_length=MAX_WAIT_ROUTES)]
    model: Name = "default"
    timeout_s: Annotated[float, Meta(ge=0.0, le=MAX_WAIT_S)] = 2.0


class RouteWaitAnswer(Struct):
    """The routes of the wait still awaiting admission (all of them: it timed out), and how long it took."""

    waiting: list[str]
    waited_s: float


class RouteRelease(Struct):
    released: int  # blocks the route held (0: unknown or already released / confirmed / expired)


class QueryRequest(Struct):
    """`POST /query`, the Dynamo / Mooncake-RFC shape. `model` is accepted as an alias."""

    token_ids: TokenList
    model_name: OptName = None
    model: OptName = None
    lora_name: OptName = None
    cache_salt: OptName = None


class QueryRequestRaw(Struct):
    """Twin of QueryRequest with `token_ids` left undecoded (see ScoreRequestRaw)."""

    token_ids: msgspec.Raw
    model_name: OptName = None
    model: OptName = None
    lora_name: OptName = None
    cache_salt: OptName = None


class QueryInstance(Struct):
    longest_matched: int  # tokens
    gpu: int
    cpu: int
    disk: int
    dp: dict[str, int]


class QueryResponse(Struct):
    instances: dict[str, QueryInstance]


# --- misc --------------------------------------------------------------------------------------

class ErrorResponse(Struct):
    error: str
    detail: Any = None


class HealthResponse(Struct):
    status: str
    workers: int
    ingest_alive: bool
    uptime_s: float
    models: dict[str, int]


json_encoder: Final = msgspec.json.Encoder()
msgpack_encoder: Final = msgspec.msgpack.Encoder()
