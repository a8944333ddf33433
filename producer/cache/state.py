"""What every part of the tiered cache shares: the attributes `TieredCache` sets up, the per-node
component-state accessors and the counters. The concern modules (matching, hybrid, transfers, l3,
eviction, audit) are mixins over this state; `TieredCache` composes them."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from producer.cache.config import CacheConfig
from producer.cache.emitter import StoreEmitter
from producer.cache.flight import Flight
from producer.components.base import Component, CompState
from producer.components.extra_pool import ExtraPool
from producer.components.full import FullAttention
from producer.events import EventRecorder
from producer.pools import KVPool
from producer.radix_tree import RadixTree, TreeNode
from schemas.media import Medium

if TYPE_CHECKING:
    from producer.cache.matching import MatchResult


class CacheState:
    """Attributes and small helpers shared by the cache's concern mixins."""

    config: CacheConfig
    page_size: int
    device: KVPool
    host: KVPool | None
    transfer: Any
    storage: Any
    l3_medium: Medium | None
    recorder: EventRecorder
    emit: StoreEmitter
    clock: Callable[[], float]
    tree: RadixTree
    components: tuple[Component, ...]
    extras: tuple[ExtraPool, ...]
    full: FullAttention
    hybrid: bool
    tick: int
    stats: dict[str, int]
    _ops: dict[int, Flight]
    _prefetches: list[Flight]
    _draining: list[Flight]  # cancelled prefetches whose reads may still land in their host pages
    _backup_retry: deque[TreeNode]
    _l3_index: dict[str, TreeNode]

    if TYPE_CHECKING:  # the seams between the concern modules: what one calls that another defines
        def match_prefix(self, tokens: Sequence[int]) -> MatchResult: ...                # matching
        def device_pages_of(self, node: TreeNode) -> list[int]: ...
        def _node_ending_at(self, key: tuple[int, ...], length: int) -> TreeNode: ...
        def _alloc_comp(self, c: Component, tier: int, n: int) -> list[int]: ...          # hybrid
        def _drop_comps(self, n: TreeNode, tier: int) -> None: ...
        def _write_backup(self, node: TreeNode) -> bool: ...                               # transfers
        def _comp_keys(self, node: TreeNode, c: Component) -> list[str]: ...               # l3
        def _backup_to_storage(self, node: TreeNode) -> None: ...
        def _unclaim_comp_l3(self, n: TreeNode, c: Component) -> bool: ...
        def alloc_device(self, n: int) -> list[int]: ...                                   # eviction
        def _alloc_host(self, n: int) -> list[int]: ...
        def _free_device(self, n: TreeNode) -> int: ...
        def _free_host(self, n: TreeNode) -> int: ...
        def _prune_if_empty(self, n: TreeNode) -> None: ...
        def evict(self, num_pages: int) -> int: ...
        def evict_host(self, num_pages: int) -> int: ...

    def _count(self, what: str, n: int = 1) -> None:
        self.stats[what] = self.stats.get(what, 0) + n

    def _state(self, n: TreeNode, c: Component) -> CompState | None:
        return n.components.get(c.name) if n.components else None

    def _new_state(self, n: TreeNode, c: Component) -> CompState:
        if n.components is None:
            n.components = {}
        st = n.components.get(c.name)
        if st is None:
            st = n.components[c.name] = CompState()
        return st

    def _clean_state(self, n: TreeNode, c: Component) -> None:
        st = self._state(n, c)
        if st is not None and st.empty:
            del n.components[c.name]  # type: ignore[union-attr]
            if not n.components:
                n.components = None
