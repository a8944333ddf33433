"""Wire and API types for kvatlas (msgspec). No logic beyond encode/decode, no torch."""
from schemas.media import Medium, parse_medium, MEDIUM_ALIASES
from schemas.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from schemas.codec import DecodeError, decode_batch, encode_batch, normalize_hash

__all__ = [
    "AllBlocksCleared", "BlockHash", "BlockRemoved", "BlockStored", "DecodeError", "KVEvent",
    "KVEventBatch", "MEDIUM_ALIASES", "Medium", "decode_batch", "encode_batch", "normalize_hash",
    "parse_medium",
]
