"""Pool builders per model family, chosen by name + sizes (docs/hybrid.md "Families").

- `full`:  full-attention KV only (today's cache).
- `mamba`: full-attention KV (group 0) + Mamba state (group 1) — Qwen3-Next / Qwen3.5 shape.
- `swa`:   full-attention KV (group 0) + sliding-window KV (group 1) — gpt-oss / Gemma shape.
- `dsa`:   MLA KV (group 0, `mla_attention`) + the DSA indexer-key pool riding on its pages —
           DeepSeek V3.2 / GLM-5 shape.
Host memory is checked for every host pool together before anything is allocated."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from producer.components.base import MLA_ATTENTION, Component, SlotPool
from producer.components.extra_pool import ExtraPool
from producer.components.full import FullAttention
from producer.components.mamba import MambaComponent
from producer.components.swa import SlidingWindowComponent
from producer.events import EventRecorder
from producer.cache import CacheConfig, TieredCache
from producer.pools import KVPool, available_host_memory

FAMILIES = ("full", "mamba", "swa", "dsa")


class FamilySizes(msgspec.Struct, frozen=True, kw_only=True):
    page_size: int
    device_pages: int
    host_pages: int = 0
    kv_shape: tuple[int, ...] = (2, 8)           # per token, after the token dim
    dtype: str = "float32"
    mamba_states: int = 16                       # device Mamba state slots
    host_mamba_states: int = 64
    conv_shape: tuple[int, ...] = (4, 8)
    temporal_shape: tuple[int, ...] = (8, 8)
    window: int = 64                             # sliding window, tokens
    swa_device_pages: int = 0                    # 0: as many as the KV pool
    swa_host_pages: int = 0
    swa_shape: tuple[int, ...] = (2, 8)
    dsa_shape: tuple[int, ...] = (8,)            # indexer keys per token


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def host_pool_plan(family: str, s: FamilySizes) -> dict[str, int]:
    """Bytes of every host pool the family needs (empty without a host tier)."""
    if not s.host_pages:
        return {}
    dt = _dtype(s.dtype)
    p = s.page_size
    plan = {"kv": SlotPool.bytes_for(s.host_pages, [(p, *s.kv_shape)], dt)}
    if family == "mamba":
        plan["mamba"] = SlotPool.bytes_for(s.host_mamba_states, [s.conv_shape, s.temporal_shape], dt)
    elif family == "swa":
        plan["swa"] = SlotPool.bytes_for(s.swa_host_pages or s.host_pages, [(p, *s.swa_shape)], dt)
    elif family == "dsa":
        plan["dsa"] = SlotPool.bytes_for(s.host_pages, [(p, *s.dsa_shape)], dt)
    return plan


def check_host_memory(plan: dict[str, int], reserve_bytes: int, available_bytes: int | None) -> None:
    avail = available_host_memory() if available_bytes is None else available_bytes
    need = sum(plan.values())
    if need + reserve_bytes > avail:
        parts = ", ".join(f"{k} {v} bytes" for k, v in plan.items())
        raise MemoryError(f"host pools need {need} bytes ({parts}) plus a {reserve_bytes}-byte reserve, "
                          f"but only {avail} bytes of host memory are available")


def build_family_cache(family: str, sizes: FamilySizes, *, transfer: Any = None, storage: Any = None,
                       recorder: EventRecorder | None = None, device: str | None = None,
                       host_reserve_bytes: int = 0, available_bytes: int | None = None,
                       **config: Any) -> TieredCache:
    """A `TieredCache` with the pools of `family` (one of FAMILIES). `config` goes to CacheConfig."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")
    s = sizes
    dt = _dtype(s.dtype)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    pin = torch.cuda.is_available()
    p = s.page_size
    check_host_memory(host_pool_plan(family, s), host_reserve_bytes, available_bytes)
    kv_shape = (p, *s.kv_shape)
    dpool = KVPool("device pool", s.device_pages, p, kv_shape, dt, dev)
    hpool = KVPool("host pool", s.host_pages, p, kv_shape, dt, "cpu", pin_memory=pin) if s.host_pages else None
    if hpool is not None and (transfer is None or isinstance(transfer, str)):
        from producer.transfer import make_transfer_engine
        transfer = make_transfer_engine(transfer or "auto")
    comps: list[Component] = []
    extras: list[ExtraPool] = []
    full = FullAttention()
    if family == "mamba":
        shapes: Sequence[Sequence[int]] = [s.conv_shape, s.temporal_shape]
        comps.append(MambaComponent(
            "mamba", 1, SlotPool("mamba state pool", s.mamba_states, shapes, dt, dev),
            SlotPool("host mamba state pool", s.host_mamba_states, shapes, dt, "cpu", pin) if hpool else None))
    elif family == "swa":
        shape = [(p, *s.swa_shape)]
        comps.append(SlidingWindowComponent(
            "swa", 1, SlotPool("swa pool", s.swa_device_pages or s.device_pages, shape, dt, dev),
            SlotPool("host swa pool", s.swa_host_pages or s.host_pages, shape, dt, "cpu", pin) if hpool else None,
            window=s.window, page_size=p))
    elif family == "dsa":
        full = FullAttention(MLA_ATTENTION)
        extras.append(ExtraPool.make("dsa", s.device_pages, s.host_pages, (p, *s.dsa_shape), dt, dev))
    return TieredCache(CacheConfig(page_size=p, **config), dpool, hpool, transfer, storage, recorder,
                       components=comps, extra_pools=extras, full=full)
