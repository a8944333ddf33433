"""Mamba (linear-attention) state: one (conv, temporal) state per node, at some nodes only.

A prefix of L pages is usable only if a state sits at page L-1 (vLLM's rule for mamba groups):
the state summarises everything before it, so a match cannot end between checkpoints.
Mamba-only eviction is a tombstone: the state goes, the node's KV stays."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from producer.components.base import MAMBA, Component, SlotPool


class MambaComponent(Component):
    per_page = False
    kind = MAMBA
    __slots__ = ()

    def valid_end(self, ends: Sequence[bool], page_ok: Sequence[bool], end: int) -> bool:
        return ends[end - 1]


def mamba_pools(num_states: int, conv_shape: Sequence[int], temporal_shape: Sequence[int],
                dtype: torch.dtype, device: str | torch.device, pin_memory: bool = False,
                name: str = "mamba") -> SlotPool:
    return SlotPool(f"{name} state pool", num_states, [conv_shape, temporal_shape], dtype, device, pin_memory)
