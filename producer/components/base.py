"""The common protocol of the cache's non-KV components (docs/hybrid.md).

Full-attention KV lives in the tree node's own fields (`value`, `host_value`, `stored`); extra
per-page pools (`ExtraPool`) ride on the KV page indices. Everything else — Mamba state, sliding-
window KV — is a `Component`: its own slot pools per tier and a `CompState` per node holding its
slots on each tier. The cache moves a node's component states together with its KV (atomic tiers)
and asks each component whether a match may end at a given page boundary.

Invariant the cache keeps: per tier, a component state is present only where the node's KV is
present on that tier (a component never outlives its KV on a tier; it may be tombstoned alone).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from producer.allocator import PageAllocator

# vLLM's KVCacheSpec kinds, as they appear in BlockStored.kv_cache_spec_kind
FULL_ATTENTION = "full_attention"
MLA_ATTENTION = "mla_attention"
SLIDING_WINDOW = "sliding_window"
MAMBA = "mamba"

DEVICE, HOST, STORAGE = 0, 1, 2     # tiers in the order a match may rely on them
MODES = ("device", "host", "any")   # device alone / device+host / any tier (L3 included)


class SlotPool:
    """One component's memory on one tier: tensors (dim 0 = slot) sharing one slot allocator.

    A Mamba state is two tensors (conv, temporal); a sliding-window page is one. Copies between
    tiers are one transfer per tensor; the L3 value of a slot is the tensors' bytes concatenated."""

    __slots__ = ("name", "tensors", "allocator")

    def __init__(self, name: str, num_slots: int, shapes: Sequence[Sequence[int]],
                 dtype: torch.dtype, device: str | torch.device, pin_memory: bool = False) -> None:
        if not shapes:
            raise ValueError(f"{name}: a slot pool needs at least one tensor")
        self.name = name
        self.allocator = PageAllocator(num_slots, name)
        self.tensors = [torch.zeros((num_slots, *[int(d) for d in s]), dtype=dtype, device=device,
                                    pin_memory=pin_memory) for s in shapes]

    @staticmethod
    def bytes_for(num_slots: int, shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> int:
        el = torch.empty((), dtype=dtype).element_size()
        return num_slots * sum(math.prod(s) for s in shapes) * el

    @property
    def slot_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors)

    def alloc(self, n: int) -> list[int]:
        return self.allocator.alloc(n)

    def free(self, slots: Sequence[int]) -> None:
        self.allocator.free(slots)

    def slot_to_bytes(self, slot: int) -> bytes:
        return b"".join(t[slot].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                        for t in self.tensors)

    def slot_from_bytes(self, slot: int, data: bytes) -> None:
        if len(data) != self.slot_bytes:
            raise ValueError(f"{self.name}: slot value has {len(data)} bytes, expected {self.slot_bytes}")
        off = 0
        buf = bytearray(data)
        for t in self.tensors:
            n = t[0].numel() * t.element_size()
            src = torch.frombuffer(buf, dtype=torch.uint8, offset=off, count=n).view(t.dtype)
            t[slot].copy_(src.view(t[slot].shape))
            off += n


class CompState:
    """A component's slots at one node, per tier (slot lists; `*_ready` False while in flight)."""

    __slots__ = ("dev", "dev_ready", "host", "host_ready", "stored")

    def __init__(self) -> None:
        self.dev: list[int] | None = None
        self.dev_ready = False
        self.host: list[int] | None = None
        self.host_ready = False
        self.stored = False

    @property
    def empty(self) -> bool:
        return self.dev is None and self.host is None and not self.stored

    def on(self, tier: int) -> bool:
        """Acknowledged on `tier` (DEVICE / HOST / STORAGE)."""
        if tier == DEVICE:
            return self.dev is not None and self.dev_ready
        if tier == HOST:
            return self.host is not None and self.host_ready
        return self.stored

    def __repr__(self) -> str:
        return f"CompState(dev={self.dev}{'' if self.dev_ready else '*'}, host={self.host}, l3={self.stored})"


class Component:
    """Base of a non-KV component. Subclasses set `per_page` and implement `valid_end`.

    - `per_page=True`: one slot per KV page of the node (sliding-window KV); a split divides them.
    - `per_page=False`: at most one slot per node, sitting at the node's last page (Mamba state);
      a split leaves it with the lower half, whose last page (and event hash) is unchanged."""

    per_page: bool = True
    kind: str = ""

    __slots__ = ("name", "group_idx", "suffix", "device", "host", "window")

    def __init__(self, name: str, group_idx: int, device: SlotPool, host: SlotPool | None = None,
                 *, suffix: str | None = None, window: int | None = None) -> None:
        if group_idx < 1:
            raise ValueError(f"{name}: group 0 is the full-attention KV; components start at 1")
        if host is not None and [t.shape[1:] for t in host.tensors] != [t.shape[1:] for t in device.tensors]:
            raise ValueError(f"{name}: host and device slot shapes differ")
        self.name = name
        self.group_idx = group_idx
        self.suffix = suffix or name
        self.device = device
        self.host = host
        self.window = window

    def pool(self, tier: int) -> SlotPool:
        p = self.host if tier == HOST else self.device
        if p is None:
            raise ValueError(f"{self.name} has no host pool")
        return p

    def slots_for(self, npages: int) -> int:
        return npages if self.per_page else 1

    def valid_end(self, ends: Sequence[bool], page_ok: Sequence[bool], end: int) -> bool:
        """May a match end after `end` pages (end >= 1)? `page_ok[i]`: this component's slot for
        page i is available in the mode; `ends[i]`: a state sits at the end of page i (per-node
        components)."""
        raise NotImplementedError
