"""Pure rules the wire types imply, each defined once and imported wherever it applies (producer,
indexer, service, C table generators). Constants and arithmetic only: no I/O, no state.
"""
from __future__ import annotations

from typing import Final

# --- tiers ---------------------------------------------------------------------------------------

# The tiers' names in the API (`TierBlocks`, `/workers` counts, tier weights), indexed by the
# tier's `schemas.media.Medium` value: GPU 0, CPU_PINNED 1, DISK 2, EXTERNAL 3.
TIER_NAMES: Final[tuple[str, str, str, str]] = ("gpu", "host", "disk", "shared")

# --- the index's residency value -----------------------------------------------------------------

# One int per block holds every worker's tiers: SLOT_BITS bits per worker slot, bit
# `SLOT_BITS * slot + tier` (tier = Medium value). The C accelerator works in 64-bit words.
SLOT_BITS: Final = 4
NIBBLE: Final = (1 << SLOT_BITS) - 1          # one slot's bits, shifted down
SLOTS_PER_WORD: Final = 64 // SLOT_BITS       # slots per 64-bit word of a residency value


def slot_shift(slot: int) -> int:
    """The bit where a worker slot's tiers start in a residency value."""
    return SLOT_BITS * slot


# --- hybrid models (docs/hybrid.md) --------------------------------------------------------------

def window_blocks(window: int, block_size: int) -> int:
    """Blocks (or pages) a sliding-window group of `window` tokens must hold before a match end:
    cdiv(W - 1, block_size), vLLM's rule (the token at the end attends to the W - 1 before it)."""
    return max(0, -(-(window - 1) // block_size))


__all__ = ["NIBBLE", "SLOTS_PER_WORD", "SLOT_BITS", "TIER_NAMES", "slot_shift", "window_blocks"]
