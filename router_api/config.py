"""The indexer service's configuration: `ServiceConfig`, one typed object checked when it is made
(`check_ingest_shards` also guards a config whose fields were set afterwards: `IndexerService`), and
the index and subscriber a config implies when the caller passes none (`default_index`,
`default_subscriber`)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from indexer.protocol import ScoringIndex, Subscriber

from router_api.locks import MAX_SHARDS
from schemas.api import RegisterWorker
from schemas.codec import DEFAULT_MAX_PAYLOAD
from schemas.rules import TIER_NAMES

TIER_KEYS = TIER_NAMES  # the tiers' API names, in Medium order


class ServiceConfig:
    __slots__ = (
        "host", "port", "model", "block_size", "static_workers", "snapshot_target", "snapshot_key",
        "snapshot_interval_s", "auth_token", "tier_weights", "stale_after_s", "remove_after_s",
        "silent_engine_factor", "resync_hold_s", "max_body_bytes", "replay_timeout_s", "poll_ms",
        "trust_engine_hashes", "stats_ttl_s", "max_workers", "max_msg_bytes", "replay_deadline_s",
        "replay_max_bytes", "snapshot_load_timeout_s", "subscribe_timeout_s", "ingest_shards",
        "tokenizers", "max_models",
    )

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 8700,
        model: str = "default",
        block_size: int = 16,
        static_workers: Sequence[RegisterWorker] = (),
        snapshot_target: str | None = None,
        snapshot_key: str = "kvatlas:snapshot",
        snapshot_interval_s: float = 30.0,
        auth_token: str | None = None,
        tier_weights: dict[str, float] | None = None,
        stale_after_s: float = 10.0,
        remove_after_s: float = 300.0,
        silent_engine_factor: float = 6.0,
        resync_hold_s: float = 30.0,
        max_body_bytes: int = 8 * 1024 * 1024,
        replay_timeout_s: float = 2.0,
        poll_ms: int = 20,
        trust_engine_hashes: bool = False,
        stats_ttl_s: float = 1.0,
        max_workers: int = 1024,
        max_msg_bytes: int = DEFAULT_MAX_PAYLOAD,
        replay_deadline_s: float | None = None,
        replay_max_bytes: int = 256 * 1024 * 1024,
        snapshot_load_timeout_s: float = 10.0,
        subscribe_timeout_s: float = 5.0,
        ingest_shards: int = 1,
        tokenizers: Any = None,
        max_models: int = 256,
    ) -> None:
        check_ingest_shards(ingest_shards, trust_engine_hashes)
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if snapshot_interval_s <= 0:
            raise ValueError("snapshot_interval_s must be > 0")
        if max_workers < 1 or max_msg_bytes < 1 or replay_max_bytes < 1 or max_models < 1:
            raise ValueError("max_workers, max_models, max_msg_bytes and replay_max_bytes must be >= 1")
        if replay_timeout_s <= 0 or snapshot_load_timeout_s < 0 or subscribe_timeout_s <= 0:
            raise ValueError("replay_timeout_s and subscribe_timeout_s must be > 0, "
                             "snapshot_load_timeout_s >= 0")
        if tier_weights:
            bad = set(tier_weights) - set(TIER_KEYS)
            if bad:
                raise ValueError(f"unknown tier weight(s) {sorted(bad)}; tiers are {TIER_KEYS}")
        self.host = host
        self.port = port
        self.model = model
        self.block_size = block_size
        self.static_workers = list(static_workers)
        self.snapshot_target = snapshot_target
        self.snapshot_key = snapshot_key
        self.snapshot_interval_s = snapshot_interval_s
        self.auth_token = auth_token or None
        self.tier_weights = dict(tier_weights) if tier_weights else None
        self.stale_after_s = stale_after_s
        self.remove_after_s = remove_after_s
        self.silent_engine_factor = silent_engine_factor
        self.resync_hold_s = resync_hold_s
        self.max_body_bytes = max_body_bytes
        self.replay_timeout_s = replay_timeout_s
        self.poll_ms = poll_ms
        self.trust_engine_hashes = trust_engine_hashes
        self.stats_ttl_s = stats_ttl_s  # how stale /workers block counts may be (they cost O(blocks))
        self.max_workers = max_workers
        self.max_msg_bytes = max_msg_bytes  # one cap for every inbound ZMQ message (ZMQ_MAXMSGSIZE)
        self.replay_deadline_s = replay_deadline_s  # None: 5 x replay_timeout_s
        self.replay_max_bytes = replay_max_bytes
        self.snapshot_load_timeout_s = snapshot_load_timeout_s  # retry an unreachable store this long
        self.subscribe_timeout_s = subscribe_timeout_s
        # Ingest pipelines (thread + sockets + index shard each); 1: one IngestLoop over one KVIndex.
        self.ingest_shards = ingest_shards
        # Models at once (a model lives while a worker of it is registered, the configured one always).
        self.max_models = max_models
        # Per-model tokenizers for /score's prompt / messages (router_api/tokenization.py): a TokenizerSet,
        # or {model: directory or ChatTokenizer}; None: token ids only.
        self.tokenizers = _tokenizer_set(tokenizers)


def _tokenizer_set(value: Any) -> Any:
    if value is None:
        return None
    from router_api.tokenization import ChatTokenizer, TokenizerSet

    if isinstance(value, TokenizerSet):
        return value
    return TokenizerSet({m: t if isinstance(t, ChatTokenizer) else ChatTokenizer.from_dir(t, name=m)
                         for m, t in dict(value).items()})


def check_ingest_shards(n: object, trust_engine_hashes: bool) -> None:
    """ValueError unless `n` is a valid `ingest_shards` for this trust mode."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SHARDS:
        raise ValueError(f"ingest_shards must be an integer from 1 to {MAX_SHARDS}, got {n!r}")
    if n > 1 and trust_engine_hashes:
        raise ValueError(f"ingest_shards={n} cannot be combined with trust_engine_hashes: trust mode keeps one "
                         "first-seen engine-hash map for all the workers of a model, which shards would split "
                         "(use ingest_shards=1)")


def default_index(config: ServiceConfig) -> ScoringIndex:
    from indexer.index import KVIndex

    weights = None
    if config.tier_weights:
        from indexer.index import TierWeights

        weights = TierWeights(**config.tier_weights)
    if config.ingest_shards > 1:
        from indexer.sharded import ShardedIndex

        return ShardedIndex(config.ingest_shards, weights=weights, trust_engine_hashes=config.trust_engine_hashes)
    return KVIndex(weights=weights, trust_engine_hashes=config.trust_engine_hashes)


def default_subscriber(config: ServiceConfig) -> Callable[[], Subscriber]:
    def factory() -> Subscriber:
        from indexer.subscriber import ZmqSubscriber

        # Bounded per poll: fewer payloads alive at once, and commands/ticks are served between chunks.
        return ZmqSubscriber(replay_timeout=config.replay_timeout_s, max_per_poll=1024,
                          replay_deadline=config.replay_deadline_s, replay_max_bytes=config.replay_max_bytes,
                          max_msg_bytes=config.max_msg_bytes, runs=True,
                          # a SUB per worker plus replay / snapshot-request DEALERs in flight
                          max_sockets=2 * config.max_workers + 64)

    return factory
