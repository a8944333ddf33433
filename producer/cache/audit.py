"""Introspection for tests and metrics: the acknowledged resident blocks per tier, and structural
checks of page ownership, tier invariants and lock counts."""
from __future__ import annotations

from producer.cache.state import CacheState
from producer.components.base import DEVICE, HOST, STORAGE
from schemas.media import Medium


class Audit(CacheState):
    """What the cache holds, as the index should see it, and whether its bookkeeping is sound."""

    def resident_blocks(self) -> set[tuple[int, Medium]]:
        """Every (event block id, tier) whose bytes are resident and acknowledged."""
        out: set[tuple[int, Medium]] = set()
        l3 = self.l3_medium
        for n in self.tree.nodes():
            if n.hollow:
                continue
            ids = self.tree.ensure_hashes(n)
            if n.value is not None and n.device_ready:
                out.update((i, Medium.GPU) for i in ids)
            if n.host_value is not None and n.host_ready:
                out.update((i, Medium.CPU_PINNED) for i in ids)
            if n.stored and l3 is not None:
                out.update((i, l3) for i in ids)
        return out

    def resident_groups(self) -> set[tuple[int, int, Medium]]:
        """Every (group_idx, block id, tier) with acknowledged bytes: group 0 is the KV, a
        component's group names the blocks its opt-in events name (docs/hybrid.md)."""
        out = {(0, i, m) for i, m in self.resident_blocks()}
        l3 = self.l3_medium
        for n in self.tree.nodes():
            for c in self.components:
                st = self._state(n, c)
                if st is None:
                    continue
                ids = self.emit.comp_blocks(n, c)[0]
                for tier, medium in ((DEVICE, Medium.GPU), (HOST, Medium.CPU_PINNED), (STORAGE, l3)):
                    if st.on(tier) and medium is not None:
                        out.update((c.group_idx, i, medium) for i in ids)
        return out

    def audit(self, exact: bool = True) -> list[str]:
        """Structural checks (tests): page ownership, tier invariants, lock counts. `exact` also
        checks that every allocated page is owned (call it when no request holds pages)."""
        problems: list[str] = []
        dev_owned: list[int] = []
        host_owned: list[int] = []
        for n in self.tree.nodes():
            if n.value is not None:
                dev_owned += n.value
                if n.parent is not self.tree.root and n.parent.value is None:  # type: ignore[union-attr]
                    problems.append(f"device node {n!r} under a device-less parent")
            if n.host_value is not None:
                host_owned += n.host_value
            if n.hollow and not n.children and not n.flights:
                problems.append(f"hollow leaf {n!r} left in the tree")
            if n.lock_ref < 0 or n.host_ref < 0:
                problems.append(f"negative refs on {n!r}")
            if n.value is not None and n.host_value is None and n.host_ready:
                problems.append(f"host_ready without host pages on {n!r}")
        comp_owned: dict[tuple[str, int], list[int]] = {}
        for n in self.tree.nodes():
            for c in self.components:
                st = self._state(n, c)
                if st is None:
                    continue
                if st.dev is not None:
                    comp_owned.setdefault((c.name, DEVICE), []).extend(st.dev)
                    if n.value is None:
                        problems.append(f"{c.name} on the device without KV at {n!r}")
                if st.host is not None:
                    comp_owned.setdefault((c.name, HOST), []).extend(st.host)
                    if n.host_value is None:
                        problems.append(f"{c.name} on the host without KV at {n!r}")
                if st.stored and not n.stored:
                    problems.append(f"{c.name} on L3 without KV at {n!r}")
        seen_f: set[int] = set()
        for f in self._ops.values():
            if f.cancelled and id(f) not in seen_f:
                seen_f.add(id(f))
                if f.kv:
                    (host_owned if f.kind == "d2h" else dev_owned).extend(f.dst_pages)
                for c, sl in f.parts:
                    comp_owned.setdefault((c.name, HOST if f.kind == "d2h" else DEVICE), []).extend(sl)
        for c in self.components:
            for tier in (DEVICE, HOST):
                if tier == HOST and c.host is None:
                    continue
                owned = comp_owned.get((c.name, tier), [])
                if len(set(owned)) != len(owned):
                    problems.append(f"a {c.name} slot is owned twice")
                if exact and c.pool(tier).allocator.used != len(owned):
                    problems.append(f"{c.name} tier {tier}: slots in use {c.pool(tier).allocator.used} != owned {len(owned)}")
        for f in (*self._prefetches, *self._draining):
            host_owned += f.dst_pages
        if len(set(dev_owned)) != len(dev_owned):
            problems.append("a device page is owned twice")
        if self.host is not None and len(set(host_owned)) != len(host_owned):
            problems.append("a host page is owned twice")
        if exact:
            if self.device.allocator.used != len(dev_owned):
                problems.append(f"device pages in use {self.device.allocator.used} != owned {len(dev_owned)}")
            if self.host is not None and self.host.allocator.used != len(host_owned):
                problems.append(f"host pages in use {self.host.allocator.used} != owned {len(host_owned)}")
        return problems
