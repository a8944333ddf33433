"""Storage media (tiers) and the aliases real engines put on the wire."""
from __future__ import annotations

import enum


class Medium(enum.IntEnum):
    """Canonical tiers, cheapest-to-use first. The int value is the tier's bit index."""

    GPU = 0
    CPU_PINNED = 1
    DISK = 2
    EXTERNAL = 3

    @property
    def bit(self) -> int:
        return 1 << self.value


# Wire name (upper-cased) -> canonical medium. `None` on the wire means GPU (vLLM, SGLang default).
MEDIUM_ALIASES: dict[str, Medium] = {
    "GPU": Medium.GPU,
    "DEVICE": Medium.GPU,
    "CUDA": Medium.GPU,
    "CPU_PINNED": Medium.CPU_PINNED,
    "CPU": Medium.CPU_PINNED,
    "CPU_TIER1": Medium.CPU_PINNED,
    "HOST": Medium.CPU_PINNED,
    "DISK": Medium.DISK,
    "CPU_TIER2": Medium.DISK,
    "NVME": Medium.DISK,
    "STORAGE": Medium.DISK,
    "LOCAL_DISK": Medium.DISK,
    "EXTERNAL": Medium.EXTERNAL,
    "SHARED": Medium.EXTERNAL,
    "REMOTE": Medium.EXTERNAL,
    "NETWORK": Medium.EXTERNAL,
}

_CACHE: dict[str | None, Medium | None] = {None: Medium.GPU}


def parse_medium(name: str | None) -> Medium | None:
    """Canonical medium for a wire string, or None when the string is unknown (caller counts it)."""
    try:
        return _CACHE[name]
    except KeyError:
        pass
    medium = MEDIUM_ALIASES.get(name.strip().upper()) if isinstance(name, str) else None
    if len(_CACHE) < 1024:  # bounded: hostile input cannot grow it without limit
        _CACHE[name] = medium
    return medium
