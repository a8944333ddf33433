"""Copies between device and host (docs/hybrid.md "Atomic tiers": one flight per node carries the KV,
every extra pool and the node's component states; it lands, or fails, as a whole) and their acks:
write-through / write-back (device → host) and load-back (host → device). A tier's `Stored` is
emitted only when its copy's ack arrives (`_finish_copy`)."""
from __future__ import annotations

import logging
from collections.abc import Sized
from typing import cast

from producer.allocator import PoolExhausted
from producer.cache.flight import Flight, depth
from producer.cache.matching import MatchResult
from producer.cache.state import CacheState
from producer.components.base import DEVICE, HOST, Component
from producer.radix_tree import TreeNode
from schemas.media import Medium

log = logging.getLogger("producer.cache")


class Transfers(CacheState):
    """Device ↔ host copies: issuing them, and applying their acks or failures."""

    def init_load_back(self, match: MatchResult, mem_quota_pages: int | None = None) -> tuple[list[int], TreeNode]:
        """Start host → device copies for the host run of `match`. Returns the device pages of the
        prefix (loading ones included) and the new device anchor. The loaded nodes are locked
        until their copies land; `Stored(GPU)` is emitted then."""
        if self.hybrid:
            return self._load_back_hybrid(match)
        node = match.host_node
        root = self.tree.root
        if self.host is None or node is None or node is root or node.parent is None or node.value is not None:
            anchor = match.device_node if match.device_node is not None and match.device_node.parent is not None else root
            return self.device_pages_of(anchor), anchor
        todo: list[TreeNode] = []
        n = node
        while n is not root and n.value is None:
            if n.host_value is None or not n.host_ready:
                todo.clear()  # the host run changed since the match: load only above this point
            else:
                todo.append(n)
            n = n.parent  # type: ignore[assignment]
        anchor = n
        todo.reverse()
        # stop at the first gap: a loaded node's parent must be device-resident
        total = 0
        chosen: list[TreeNode] = []
        for x in todo:
            if mem_quota_pages is not None and total + len(x.host_value) > mem_quota_pages:  # type: ignore[arg-type]
                break
            chosen.append(x)
            total += len(x.host_value)  # type: ignore[arg-type]
        if not chosen:
            return self.device_pages_of(anchor), anchor
        # Pin the path on the device and the host run on the host: the device eviction below may
        # write back (allocating host pages, evicting host copies) under write-back.
        self.tree.inc_lock(chosen[-1])
        for x in chosen:
            x.host_ref += 1
        try:
            pages = self.alloc_device(total)
        except PoolExhausted as exc:
            self._count("load_back_no_device_memory")
            log.debug("load-back skipped: %s", exc)
            for x in chosen:
                x.host_ref -= 1
            self.tree.dec_lock(chosen[-1])
            return self.device_pages_of(anchor), anchor
        off = 0
        for x in chosen:
            k = len(x.host_value)  # type: ignore[arg-type]
            pg = pages[off:off + k]
            off += k
            x.value = pg
            x.device_ready = False  # keeps the host_ref taken above until the copy lands
            f = Flight("h2d", pg)
            f.attach(x)
            f.lock_node = x
            self.tree.inc_lock(x)
            self._submit_kv(f, True, x.host_value, pg)  # type: ignore[arg-type]
        self.tree.dec_lock(chosen[-1])
        self._count("load_back_pages", total)
        return self.device_pages_of(chosen[-1]), chosen[-1]

    def _load_back_hybrid(self, match: MatchResult) -> tuple[list[int], TreeNode]:
        """Load, for every component, exactly what the device lacks between the anchor and the
        host-usable end: KV pages, the window's sliding-window pages (possibly above the anchor:
        aux-only), the Mamba state at the end (aux-only when its KV is on the device)."""
        root = self.tree.root
        anchor = match.device_node if match.device_node is not None else root
        target = match.host_node
        if self.host is None or target is None or target is anchor or target.parent is None:
            return self.device_pages_of(anchor), anchor
        chain: list[TreeNode] = []
        n = target
        while n is not anchor and n is not root and n is not None:
            chain.append(n)
            n = n.parent  # type: ignore[assignment]
        if n is not anchor:
            return self.device_pages_of(anchor), anchor  # the tree changed since the match
        chain.reverse()
        plan: dict[int, tuple[TreeNode, bool, list[Component]]] = {}
        for x in chain:
            if x.value is None:
                if x.host_value is None or not x.host_ready:
                    return self.device_pages_of(anchor), anchor
                plan[id(x)] = (x, True, [])
        for c in self.components:
            need: list[TreeNode] = []
            if c.per_page:
                want = c.need  # type: ignore[attr-defined]
                x = target
                while want > 0 and x is not root:
                    need.append(x)
                    want -= len(x.key) // self.page_size
                    x = x.parent  # type: ignore[assignment]
            else:
                need = [target]
            for x in need:
                st = self._state(x, c)
                if st is not None and st.dev is not None:
                    continue  # on the device, or already loading
                if st is None or not st.on(HOST):
                    return self.device_pages_of(anchor), anchor
                plan.setdefault(id(x), (x, False, []))[2].append(c)
        if not plan:
            return self.device_pages_of(target), target
        items = list(plan.values())
        self.tree.inc_lock(target)
        for x, _, _ in items:
            x.host_ref += 1
        got: dict[str, list[int]] = {}
        kv_pages: list[int] = []
        try:
            kv_total = sum(len(cast(Sized, x.host_value)) for x, kv, _ in items if kv)  # kv items hold a host value
            kv_pages = self.alloc_device(kv_total)
            for c in self.components:
                k = sum(c.slots_for(len(x.key) // self.page_size) for x, _, cs in items if c in cs)
                if k:
                    got[c.name] = self._alloc_comp(c, DEVICE, k)
        except PoolExhausted as exc:
            self._count("load_back_no_device_memory")
            log.debug("load-back skipped: %s", exc)
            self.device.free(kv_pages)
            for c in self.components:
                if c.name in got:
                    c.device.free(got[c.name])
            for x, _, _ in items:
                x.host_ref -= 1
            self.tree.dec_lock(target)
            return self.device_pages_of(anchor), anchor
        off = 0
        coff = {c.name: 0 for c in self.components}
        for x, kv, cs in items:
            f = Flight("h2d")
            f.kv = kv
            if kv:
                k = len(x.host_value)  # type: ignore[arg-type]
                f.dst_pages = kv_pages[off:off + k]
                off += k
                x.value, x.device_ready = f.dst_pages, False
                self._submit_kv(f, True, x.host_value, f.dst_pages)  # type: ignore[arg-type]
            for c in cs:
                st = self._state(x, c)
                k = c.slots_for(len(x.key) // self.page_size)
                sl = got[c.name][coff[c.name]:coff[c.name] + k]
                coff[c.name] += k
                st.dev, st.dev_ready = sl, False  # type: ignore[union-attr]
                f.parts.append((c, sl))
                self._submit_comp(f, c, HOST, st.host, sl)  # type: ignore[union-attr, arg-type]
            f.attach(x)
            f.lock_node = x
            self.tree.inc_lock(x)
        self.tree.dec_lock(target)
        self._count("load_back_pages", kv_total)
        return self.device_pages_of(target), target

    def _submit_kv(self, f: Flight, from_host: bool, src: list[int], dst: list[int]) -> None:
        """Copy KV pages and every extra pool's same pages: one op per tensor, one flight."""
        h, d = self.host.buffer, self.device.buffer  # type: ignore[union-attr]
        pairs = [(h, d) if from_host else (d, h)]
        pairs += [((x.host, x.device) if from_host else (x.device, x.host)) for x in self.extras]
        for a, b in pairs:
            self._ops[self.transfer.submit(a, src, b, dst, f)] = f
            f.pending += 1

    def _submit_comp(self, f: Flight, c: Component, src_tier: int, src: list[int], dst: list[int]) -> None:
        sp = c.pool(src_tier)
        dp = c.pool(DEVICE if src_tier == HOST else HOST)
        for a, b in zip(sp.tensors, dp.tensors):
            self._ops[self.transfer.submit(a, src, b, dst, f)] = f
            f.pending += 1

    def _write_backup(self, node: TreeNode) -> bool:
        """Start a device → host copy of `node`. `Stored(CPU_PINNED)` waits for its ack."""
        if self.host is None or node.host_value is not None or node.value is None or not node.device_ready:
            return False
        comps = [c for c in self.components if (st := self._state(node, c)) is not None and st.on(DEVICE)]
        try:
            hp = self._alloc_host(len(node.value))
        except PoolExhausted:
            self._count("write_backup_no_host_memory")
            return False
        got: list[tuple[Component, list[int]]] = []
        try:
            for c in comps:
                got.append((c, self._alloc_comp(c, HOST, len(self._state(node, c).dev))))  # type: ignore[union-attr, arg-type]
        except PoolExhausted:
            self.host.free(hp)
            for c, sl in got:
                c.pool(HOST).free(sl)
            self._count("write_backup_no_host_memory")
            return False
        node.host_value = hp
        node.host_ready = False
        f = Flight("d2h", hp)
        f.attach(node)
        f.lock_node = node
        self.tree.inc_lock(node)  # the source pages must stay put until the copy lands
        self._submit_kv(f, False, node.value, hp)
        for c, sl in got:
            st = self._state(node, c)
            st.host, st.host_ready = sl, False  # type: ignore[union-attr]
            f.parts.append((c, sl))
            self._submit_comp(f, c, DEVICE, st.dev, sl)  # type: ignore[union-attr, arg-type]
        self._count("write_backup_pages", len(hp))
        return True

    def _free_parts(self, f: Flight) -> None:
        dst = HOST if f.kind == "d2h" else DEVICE
        for c, sl in f.parts:
            c.pool(dst).free(sl)

    def _finish_copy(self, f: Flight) -> None:
        if f.cancelled:
            if f.kv:
                pool = self.host if f.kind == "d2h" else self.device
                pool.free(f.dst_pages)  # type: ignore[union-attr]
            self._free_parts(f)
            return
        nodes = sorted(f.nodes, key=depth)  # parents first: events chain from known blocks
        f.detach_all()
        landed: list[tuple[TreeNode, Component]] = []
        comps = [c for c, _ in f.parts]
        to_host = f.kind == "d2h"
        medium = Medium.CPU_PINNED if to_host else Medium.GPU
        for n in nodes:
            if f.kv:
                if to_host:
                    n.host_ready = True
                else:
                    n.device_ready = True
                self.emit.stored(n, medium)
            for c in comps:
                st = self._state(n, c)
                if st is None:
                    continue
                if to_host and st.host is not None and not st.host_ready:
                    st.host_ready = True
                    landed.append((n, c))
                elif not to_host and st.dev is not None and not st.dev_ready:
                    st.dev_ready = True
                    landed.append((n, c))
            if not to_host:
                n.host_ref -= 1
        for n, c in landed:  # after the KV stores: a group's block always follows its KV block
            self.emit.comp(n, c, medium, True)
        self.tree.dec_lock(f.lock_node)  # type: ignore[arg-type]
        if to_host:
            for n in nodes:
                self._backup_to_storage(n)

    def _fail_copy(self, f: Flight, reason: str) -> None:
        self._count(f"copy_failed_{f.kind}")
        log.error("%s copy failed: %s", f.kind, reason)
        if f.cancelled:
            if f.kv:
                (self.host if f.kind == "d2h" else self.device).free(f.dst_pages)  # type: ignore[union-attr]
            self._free_parts(f)
            return
        nodes = list(f.nodes)
        f.detach_all()
        comps = [c for c, _ in f.parts]
        for n in nodes:
            for c in comps:  # the states this flight was filling never landed
                st = self._state(n, c)
                if st is None:
                    continue
                if f.kind == "d2h" and st.host is not None and not st.host_ready:
                    c.pool(HOST).free(st.host)
                    st.host = None
                elif f.kind == "h2d" and st.dev is not None and not st.dev_ready:
                    c.device.free(st.dev)
                    st.dev = None
                self._clean_state(n, c)
            if f.kind == "d2h":
                if f.kv:
                    self._free_host(n)
            else:
                if f.kv:
                    self._free_device(n)
                n.host_ref -= 1
        self.tree.dec_lock(f.lock_node)  # type: ignore[arg-type]

    def _apply_completions(self, done: list[tuple[int, object]]) -> None:
        # A flight is one op per pool tensor; it lands when the last op does, and fails as a
        # whole if any op failed (never a partial page).
        for op, _tag in done:
            f = self._ops.pop(op, None)
            if f is not None:
                f.pending -= 1
                if f.pending == 0:
                    self._fail_copy(f, f.failed) if f.failed else self._finish_copy(f)
        for op, _tag, reason in self.transfer.poll_failed():
            f = self._ops.pop(op, None)
            if f is not None:
                f.failed = f.failed or reason
                f.pending -= 1
                if f.pending == 0:
                    self._fail_copy(f, f.failed)

    def wait_transfers(self, timeout: float | None = None) -> None:
        """Block until in-flight copies land and apply their acks (write-back under memory
        pressure, shutdown). Events for them go out at the next `step`."""
        if self.transfer is not None and self._ops:
            self._apply_completions(self.transfer.wait_all(timeout))
