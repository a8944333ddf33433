"""The cache's configuration: page size, write policy, L3 backup and prefetch thresholds, hashing."""
from __future__ import annotations

import msgspec

from producer.page_hash import page_hash_chain

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    page_size: int
    write_policy: str = "write_through"
    write_through_threshold: int = 2          # hits before a selective write-through copies to host
    storage_backup: bool = True               # back host pages up to L3 once their host copy landed
    prefetch_threshold_tokens: int = 256      # prefetch only when L3 could add at least this many
    prefetch_timeout_base_s: float = 1.0
    prefetch_timeout_per_1k_tokens_s: float = 0.25
    storage_suffix: str | None = None         # L3 key suffix of this pool (extra pools differ)
    page_hash: str = "sha256"                 # "sha256" (SGLang-compatible ids) or "xxh3" (cheaper)
    component_events: bool = False            # also emit per-group events in vLLM's shape (docs/hybrid.md)

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if self.write_through_threshold < 1:
            raise ValueError("write_through_threshold must be >= 1")
        page_hash_chain(self.page_hash)  # fails early with a clear message
