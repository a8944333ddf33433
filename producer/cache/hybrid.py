"""Hybrid models' components (Mamba state, sliding-window KV) on the tree: checking them, taking
the engine's slots on insert, reporting their indices, and tombstoning their LRU states alone."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from producer.cache.state import CacheState
from producer.components.base import DEVICE, HOST, Component
from producer.components.extra_pool import ExtraPool
from producer.pools import KVPool
from producer.radix_tree import TreeNode
from schemas.media import Medium


class Hybrid(CacheState):
    """Component states: insert, indices, allocation and component-only eviction."""

    @staticmethod
    def _check_components(components: Sequence[Component], extras: Sequence[ExtraPool],
                          device: KVPool, host: KVPool | None) -> None:
        names: set[str] = set()
        groups: set[int] = set()
        suffixes: set[str] = set()
        every: list[Component | ExtraPool] = [*components, *extras]
        for c in every:
            if c.name in names or c.suffix in suffixes:
                raise ValueError(f"component name/L3 suffix {c.name!r}/{c.suffix!r} used twice")
            names.add(c.name)
            suffixes.add(c.suffix)
        for c in components:
            if c.group_idx in groups:
                raise ValueError(f"group_idx {c.group_idx} used by two components")
            groups.add(c.group_idx)
            if (host is None) != (c.host is None):
                raise ValueError(f"{c.name}: a component has a host pool exactly when the cache has a host tier")
        for x in extras:
            if x.device.shape[0] != device.num_pages:
                raise ValueError(f"{x.name}: extra pool has {x.device.shape[0]} device pages, KV has {device.num_pages}")
            if (host is None) != (x.host is None) or (host is not None and x.host.shape[0] != host.num_pages):  # type: ignore[union-attr]
                raise ValueError(f"{x.name}: extra pool host pages must match the KV host pool")

    def _take_components(self, key: tuple[int, ...], path: list[tuple[TreeNode, int]],
                         given: dict[str, Any]) -> None:
        """Attach the engine's component slots to the inserted path (the cache takes ownership;
        slots duplicating state already cached, or for KV not on the device, are freed)."""
        p = self.page_size
        unknown = set(given) - {c.name for c in self.components}
        if unknown:
            raise ValueError(f"insert names unknown components {sorted(unknown)}")
        npages = len(key) // p
        for c in self.components:
            g = given.get(c.name)
            if g is None:
                continue
            spare: list[int] = []
            if c.per_page:
                slots = list(g)
                for node, off in path:
                    a, k = off // p, len(node.key) // p
                    sl = slots[a:a + k]
                    st = self._state(node, c)
                    if (node.value is not None and node.device_ready and (st is None or st.dev is None)
                            and len(sl) == k and all(x is not None for x in sl)):
                        st = self._new_state(node, c)
                        st.dev, st.dev_ready = [int(x) for x in sl], True
                        self.emit.comp(node, c, Medium.GPU, True)
                    else:
                        spare.extend(int(x) for x in sl if x is not None)
                spare.extend(int(x) for x in slots[npages:] if x is not None)
            else:
                for end, slot in sorted(dict(g).items()):
                    if not 0 < end <= npages:
                        spare.append(int(slot))
                        continue
                    node = self._node_ending_at(key, end * p)
                    st = self._state(node, c)
                    if node.value is not None and node.device_ready and (st is None or st.dev is None):
                        st = self._new_state(node, c)
                        st.dev, st.dev_ready = [int(slot)], True
                        self.emit.comp(node, c, Medium.GPU, True)
                    else:
                        spare.append(int(slot))
            if spare:
                c.device.free(spare)

    def component_indices(self, node: TreeNode) -> dict[str, list[int | None]]:
        """Device indices each component provides for the prefix ending at `node` (loading ones
        included): per-page components one entry per page (None where tombstoned), per-node
        components the state at `node` (empty when none)."""
        chain = []
        n = node
        while n is not None and n is not self.tree.root:
            chain.append(n)
            n = n.parent  # type: ignore[assignment]
        chain.reverse()
        out: dict[str, list[int | None]] = {}
        for c in self.components:
            if c.per_page:
                idx: list[int | None] = []
                for x in chain:
                    st = self._state(x, c)
                    k = len(x.key) // self.page_size
                    idx.extend(st.dev if st is not None and st.dev is not None else [None] * k)
                out[c.name] = idx
            else:
                st = self._state(node, c) if chain else None
                out[c.name] = list(st.dev) if st is not None and st.dev is not None else []
        return out

    def alloc_component(self, name: str, n: int) -> list[int]:
        """Device slots of component `name` for new state (tombstoning LRU states, then evicting
        LRU device KV if needed; PoolExhausted if not)."""
        return self._alloc_comp(self._component(name), DEVICE, n)

    def _component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no component {name!r} (have {[c.name for c in self.components]})")

    def _alloc_comp(self, c: Component, tier: int, n: int) -> list[int]:
        pool = c.pool(tier)
        short = n - pool.allocator.available
        if short > 0:
            self._evict_comp(c, tier, short)
        short = n - pool.allocator.available
        if short > 0:  # whole nodes next: their states go with their KV
            (self.evict if tier == DEVICE else self.evict_host)(short)
        return pool.alloc(n)

    def evict_component(self, name: str, num_slots: int, tier: str = "device") -> int:
        """Tombstone LRU states of one component (Mamba-only / SWA-only eviction): their slots
        are freed, the nodes' KV stays. Silent by default; a group remove with component_events."""
        if tier not in ("device", "host"):
            raise ValueError(f"tier must be 'device' or 'host', got {tier!r}")
        c = self._component(name)
        if tier == "host" and c.host is None:
            return 0
        return self._evict_comp(c, DEVICE if tier == "device" else HOST, num_slots)

    def _evict_comp(self, c: Component, tier: int, need: int) -> int:
        cands = []
        for n in self.tree.nodes():
            st = self._state(n, c)
            if st is None or not st.on(tier) or n.flights:
                continue
            if (n.lock_ref if tier == DEVICE else n.host_ref) > 0:
                continue  # a request (or a copy) is using it
            cands.append((n.last_access, n.nid, n))
        cands.sort()
        freed = 0
        medium = Medium.GPU if tier == DEVICE else Medium.CPU_PINNED
        for _, _, n in cands:
            if freed >= need:
                break
            st = self._state(n, c)
            slots = st.dev if tier == DEVICE else st.host  # type: ignore[union-attr]
            self.emit.comp(n, c, medium, False)
            c.pool(tier).free(slots)  # type: ignore[arg-type]
            if tier == DEVICE:
                st.dev, st.dev_ready = None, False  # type: ignore[union-attr]
            else:
                st.host, st.host_ready = None, False  # type: ignore[union-attr]
            freed += len(slots)  # type: ignore[arg-type]
            self._clean_state(n, c)
        if freed:
            self._count(f"{c.name}_tombstoned_slots", freed)
        return freed

    def _drop_comps(self, n: TreeNode, tier: int) -> None:
        """Free every component's slots on `tier` at `n` (its KV leaves that tier)."""
        if not n.components:
            return
        medium = Medium.GPU if tier == DEVICE else Medium.CPU_PINNED
        for c in self.components:
            st = self._state(n, c)
            if st is None:
                continue
            if tier == DEVICE and st.dev is not None:
                if st.dev_ready:
                    self.emit.comp(n, c, medium, False)
                c.device.free(st.dev)
                st.dev, st.dev_ready = None, False
            elif tier == HOST and st.host is not None:
                if st.host_ready:
                    self.emit.comp(n, c, medium, False)
                c.pool(HOST).free(st.host)
                st.host, st.host_ready = None, False
            self._clean_state(n, c)
