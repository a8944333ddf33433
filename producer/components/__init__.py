"""Hybrid-model components of the tiered cache (docs/hybrid.md). Importing this imports torch."""
from producer.components.base import (FULL_ATTENTION, MAMBA, MLA_ATTENTION, SLIDING_WINDOW, Component,
                                      CompState, SlotPool)
from producer.components.extra_pool import ExtraPool
from producer.components.full import FullAttention
from producer.components.mamba import MambaComponent
from producer.components.swa import SlidingWindowComponent, window_pages

__all__ = ["FULL_ATTENTION", "MAMBA", "MLA_ATTENTION", "SLIDING_WINDOW", "CompState", "Component", "ExtraPool",
           "FullAttention", "MambaComponent", "SlidingWindowComponent", "SlotPool", "window_pages"]
