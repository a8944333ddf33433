"""The full-attention KV component: group 0 of every stream.

Its pages are the tree nodes' own `value` / `host_value` / `stored` fields (the tiered cache's
original state, so full-attention-only caches behave and emit exactly as before). A match may end
at L only if pages [0, L) are available in the mode. `kind` is `full_attention`, or
`mla_attention` for MLA models (DeepSeek); both are full-attention for scoring."""
from __future__ import annotations

from producer.components.base import FULL_ATTENTION, MLA_ATTENTION


class FullAttention:
    __slots__ = ("kind",)
    group_idx = 0

    def __init__(self, kind: str = FULL_ATTENTION) -> None:
        if kind not in (FULL_ATTENTION, MLA_ATTENTION):
            raise ValueError(f"full-attention kind must be {FULL_ATTENTION!r} or {MLA_ATTENTION!r}, got {kind!r}")
        self.kind = kind
