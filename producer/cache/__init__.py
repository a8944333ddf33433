"""The tiered KV cache a worker embeds (`TieredCache`) and its configuration."""
from producer.cache.config import WRITE_POLICIES, CacheConfig
from producer.cache.matching import MatchResult
from producer.cache.tiered_cache import TieredCache

__all__ = ["WRITE_POLICIES", "CacheConfig", "MatchResult", "TieredCache"]
