"""Allocation under pressure and LRU eviction per tier. The tier invariants it keeps: device-resident
nodes stay prefix-closed (only device leaves are evicted), a device-less node keeps its host copy
while a child still has a device or host copy, and a node no tier holds leaves the tree."""
from __future__ import annotations

from producer.cache.state import CacheState
from producer.components.base import DEVICE, HOST
from producer.radix_tree import TreeNode
from schemas.media import Medium


class Eviction(CacheState):
    """Free pages on a tier by evicting its least recently used nodes."""

    def alloc_device(self, n: int) -> list[int]:
        """Device pages for new KV, evicting LRU device pages if needed (PoolExhausted if not)."""
        short = n - self.device.allocator.available
        if short > 0:
            self.evict(short)
        return self.device.alloc(n)

    def _alloc_host(self, n: int) -> list[int]:
        short = n - self.host.allocator.available  # type: ignore[union-attr]
        if short > 0:
            self.evict_host(short)
        return self.host.alloc(n)  # type: ignore[union-attr]

    def _free_device(self, n: TreeNode) -> int:
        self._drop_comps(n, DEVICE)
        k = len(n.value)  # type: ignore[arg-type]
        self.device.free(n.value)  # type: ignore[arg-type]
        n.value = None
        n.device_ready = False
        return k

    def _free_host(self, n: TreeNode) -> int:
        self._drop_comps(n, HOST)
        k = len(n.host_value)  # type: ignore[arg-type]
        self.host.free(n.host_value)  # type: ignore[union-attr, arg-type]
        n.host_value = None
        n.host_ready = False
        return k

    def _prune_if_empty(self, n: TreeNode) -> None:
        """A node no tier holds any more and with no children leaves the tree."""
        if n.hollow and not n.children and n.parent is not None:
            for c in self.components:  # only an L3-less tombstone record can be left here
                self._unclaim_comp_l3(n, c)
            n.components = None
            self.tree.prune(n)

    def _device_candidate(self, n: TreeNode) -> bool:
        if n.value is None or not n.device_ready or n.lock_ref > 0:
            return False
        for c in n.children.values():
            if c.value is not None:
                return False
        return True

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` device pages if possible (LRU device leaves). Under
        write-back, leaves without a host copy are written back first and freed once it lands."""
        writeback_budget = [num_pages]

        def evict_one(n: TreeNode) -> int:
            k = len(n.value)  # type: ignore[arg-type]
            if n.host_value is None and self.config.write_policy == "write_back" and writeback_budget[0] > 0:
                if self._write_backup(n):
                    writeback_budget[0] -= k
                    return 0
            self._free_device(n)
            self.emit.removed(n, Medium.GPU)
            self._count("device_evicted_pages", k)
            self._prune_if_empty(n)
            return k

        return self.tree.evict_lru(num_pages, self._device_candidate, evict_one)

    def _host_candidate(self, n: TreeNode) -> bool:
        if n.host_value is None or not n.host_ready or n.host_ref > 0:
            return False
        if n.value is not None:
            return True  # dropping a host copy of device-resident KV loses nothing
        for c in n.children.values():
            if c.value is not None or c.host_value is not None:
                return False
        return True

    def evict_host(self, num_pages: int) -> int:
        if self.host is None:
            return 0

        def evict_one(n: TreeNode) -> int:
            k = self._free_host(n)
            self.emit.removed(n, Medium.CPU_PINNED)
            self._count("host_evicted_pages", k)
            self._prune_if_empty(n)
            return k

        return self.tree.evict_lru(num_pages, self._host_candidate, evict_one)
