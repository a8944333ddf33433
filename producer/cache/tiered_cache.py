"""The tiered KV cache a worker embeds: device (L1) / host (L2) / storage (L3) over one radix tree.

Semantics follow SGLang's HiRadixCache (write-through, selective write-through, write-back,
load-back, L3 backup and prefetch) with one deliberate difference: every `Stored` event is emitted
only after the copy that put the bytes on that tier has been acknowledged (design §3) — including
load-back, which SGLang announces at issue. `StoreEmitter` (emitter.py) is the one place stores are
recorded, and it refuses a store for bytes not acknowledged on that tier.

`TieredCache` is the facade an engine calls; each concern lives in its own module as a mixin over
the shared state (state.py): matching.py, hybrid.py (components), transfers.py (device ↔ host
copies and acks), l3.py, eviction.py, audit.py.

Threading: everything here runs on the scheduler thread. Copies run on the transfer engine, L3 I/O
on the storage I/O thread; their acks are picked up by `step()` (SGLang's `writing_check` /
`loading_check`), which the engine calls once per scheduling step.

Tier invariants the eviction rules keep:
- device-resident nodes form a prefix-closed set (only device leaves are device-evicted);
- a device-less node keeps its host copy while a child still has a device or host copy;
- a node holding no tier ("hollow") stays only while it has children; a match stops before it.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from producer.cache.audit import Audit
from producer.cache.config import CacheConfig
from producer.cache.emitter import StoreEmitter
from producer.cache.eviction import Eviction
from producer.cache.flight import Flight
from producer.cache.hybrid import Hybrid
from producer.cache.l3 import L3
from producer.cache.matching import Matching
from producer.cache.transfers import Transfers
from producer.components.base import DEVICE, HOST, STORAGE, Component, CompState
from producer.components.extra_pool import ExtraPool
from producer.components.full import FullAttention
from producer.events import EventRecorder
from producer.page_hash import DIGEST_LEN, page_hash_chain, page_hash_chain_blob
from producer.pools import KVPool
from producer.radix_tree import RadixTree, TreeNode
from producer.storage.base import backend_medium
from schemas.media import Medium


class TieredCache(Matching, Hybrid, Transfers, L3, Eviction, Audit):
    """Radix prefix cache over device / host / L3 tiers with acknowledged, medium-aware events.

    Device-only use (`host_pool=None`) is a plain radix cache with the same events."""

    def __init__(self, config: CacheConfig, device_pool: KVPool, host_pool: KVPool | None = None,
                 transfer: Any = None, storage: Any = None, recorder: EventRecorder | None = None,
                 *, clock: Callable[[], float] = time.monotonic,
                 components: Sequence[Component] = (), extra_pools: Sequence[ExtraPool] = (),
                 full: FullAttention | None = None) -> None:
        if device_pool.page_size != config.page_size:
            raise ValueError(f"device pool page size {device_pool.page_size} != cache page size {config.page_size}")
        if host_pool is not None:
            if transfer is None:
                raise ValueError("a host tier needs a transfer engine")
            if host_pool.page_shape != device_pool.page_shape or host_pool.buffer.dtype != device_pool.buffer.dtype:
                raise ValueError("host and device pools must have the same page shape and dtype")
        if storage is not None and host_pool is None:
            raise ValueError("L3 storage needs a host tier (backups and prefetches go through host memory)")
        self._check_components(components, extra_pools, device_pool, host_pool)
        self.components = tuple(components)
        self.extras = tuple(extra_pools)
        self.full = full or FullAttention()
        self.hybrid = bool(self.components)  # extra pools alone keep full-attention match semantics
        self.config = config
        self.page_size = config.page_size
        self.device = device_pool
        self.host = host_pool
        self.transfer = transfer
        self.storage = storage
        self.l3_medium = backend_medium(storage.backend) if storage is not None else None
        self.recorder = recorder if recorder is not None else EventRecorder(None, enabled=False)
        self.clock = clock
        self.tree = RadixTree(config.page_size, split_hook=self._on_split,
                              chain=page_hash_chain(config.page_hash),
                              chain_blob=page_hash_chain_blob(config.page_hash),
                              digest_len=DIGEST_LEN[config.page_hash])
        self.emit = StoreEmitter(self.recorder, self.tree, self.page_size, config.page_hash,
                                 config.component_events, self.full.kind)
        self.tick = 0  # logical LRU time
        self._ops: dict[int, Flight] = {}
        self._prefetches: list[Flight] = []
        self._draining: list[Flight] = []
        self._backup_retry: deque[TreeNode] = deque()
        self._l3_index: dict[str, TreeNode] = {}
        self.stats: dict[str, int] = {}

    def _on_split(self, new: TreeNode, child: TreeNode) -> None:
        # Bookkeeping that names `child` must now also name its new prefix half.
        for f in child.flights:
            f.attach(new)
        if new.stored and new.digests is not None:
            for k in self._l3_keys(new):
                self._l3_index[k] = new
        if child.components:
            pg = len(new.key) // self.page_size
            comps = {}
            for c in self.components:
                st = child.components.get(c.name)
                if st is None or not c.per_page:
                    continue  # a Mamba state sits at the child's end: it stays with the child
                ns = CompState()
                if st.dev is not None:
                    ns.dev, st.dev = st.dev[:pg], st.dev[pg:]
                if st.host is not None:
                    ns.host, st.host = st.host[:pg], st.host[pg:]
                ns.dev_ready, ns.host_ready, ns.stored = st.dev_ready, st.host_ready, st.stored
                comps[c.name] = ns
                if ns.stored and new.digests is not None:
                    for k in self._comp_keys(new, c):
                        self._l3_index[k] = new
            new.components = comps or None

    def insert(self, tokens: Sequence[int], device_pages: Sequence[int], *,
               component_pages: dict[str, Any] | None = None) -> int:
        """Record KV the engine computed on the device for the whole pages of `tokens`.

        `device_pages[i]` holds page i. The cache takes ownership of the first
        `len(tokens) // page_size` pages: pages duplicating KV already cached are freed here.
        Returns the number of tokens that were already device-resident."""
        key = self.tree.page_key(tokens)
        npages = len(key) // self.page_size
        pages = [int(p) for p in device_pages[:npages]]
        if len(pages) < npages:
            raise ValueError(f"insert of {npages} pages got only {len(pages)} device pages")
        self.tick += 1
        path, new = self.tree.insert_path(key, self.tick)
        new_off = path[-1][1] if new is not None else -1
        p = self.page_size
        policy = self.config.write_policy
        prefix = 0
        dup: list[int] = []
        backup: list[TreeNode] = []
        for node, off in path:
            a = off // p
            pg = pages[a:a + len(node.key) // p]
            if node.value is None:  # new leaf, or a device-evicted node the engine recomputed
                node.value = pg
                node.device_ready = True
                self.emit.stored(node, Medium.GPU)
                if policy == "write_through" and node is new:
                    backup.append(node)
                continue
            prefix += len(node.key)
            dup.extend(q for q, v in zip(pg, node.value) if q != v)
            node.hit_count += 1
            if (policy == "write_through_selective" and node.host_value is None
                    and node.hit_count >= self.config.write_through_threshold):
                backup.append(node)
        if dup:
            self.device.free(dup)
        if component_pages:
            self._take_components(key, path, component_pages)
            if new_off >= 0 and policy == "write_through":
                # a Mamba state may have split the new leaf: back up every half of it
                backup = [n for n in backup if n is not new]
                backup += [n for n, off in self.tree.insert_path(key, self.tick)[0] if off >= new_off]
        # after the walk: host allocation may evict host copies of nodes on this very path
        for node in backup:
            self._write_backup(node)
        return prefix

    def lock(self, node: TreeNode) -> None:
        """Keep `node` and its ancestors on the device (a request is using them)."""
        if node is not self.tree.root:
            self.tree.inc_lock(node)

    def unlock(self, node: TreeNode) -> None:
        if node is not self.tree.root:
            self.tree.dec_lock(node)

    def step(self, now: float | None = None) -> None:
        """Observe finished copies and storage results, expire prefetches, send events."""
        now = self.clock() if now is None else now
        if self.transfer is not None:
            self._apply_completions(self.transfer.poll())
        if self.storage is not None:
            self._poll_storage(now)
        if self.recorder.snapshot_requested():
            self.recorder.flush(now)  # what happened so far goes first: the snapshot batch starts with the clear
            self.emit_snapshot()
        self.recorder.flush(now)

    # SGLang's names for the ack polling done by step()
    writing_check = step
    loading_check = step

    def emit_snapshot(self) -> None:
        """Describe the whole acknowledged state in the next batch: `AllBlocksCleared`, then a
        store per (node, tier) exactly as `resident_blocks()` reports them, parents before children.
        A consumer applying the batch ends with this worker's exact state (resync after a loss the
        replay buffer could not cover). Copies still in flight are announced by their own acks."""
        rec = self.recorder
        if not rec.enabled:
            return
        rec.cleared()
        l3 = self.l3_medium
        for n in self.tree.nodes():  # preorder: a parent's stores precede its children's
            if n.hollow:
                continue
            if n.value is not None and n.device_ready:
                self.emit.stored(n, Medium.GPU)
            if n.host_value is not None and n.host_ready:
                self.emit.stored(n, Medium.CPU_PINNED)
            if n.stored and l3 is not None:
                self.emit.stored(n, l3)
            for c in self.components:
                st = self._state(n, c)
                if st is None:
                    continue
                for tier, medium in ((DEVICE, Medium.GPU), (HOST, Medium.CPU_PINNED), (STORAGE, l3)):
                    if st.on(tier) and medium is not None:
                        self.emit.comp(n, c, medium, True)
        self._count("snapshots")

    def reset(self) -> None:
        """Drop everything on every tier (`AllBlocksCleared`). In-flight copies are cancelled; their
        destination pages return to the pools when they land."""
        cancelled: set[int] = set()
        for f in self._ops.values():
            f.cancelled = True
            cancelled.add(id(f))
        for n in self.tree.nodes():  # component slots held by a node (in-flight ones: by their flight)
            for c in self.components:
                st = self._state(n, c)
                if st is None:
                    continue
                if st.dev is not None and st.dev_ready:
                    c.device.free(st.dev)
                if st.host is not None and st.host_ready:
                    c.pool(HOST).free(st.host)
            n.components = None
        for f in list(self._prefetches):
            f.cancelled = True
            self._prefetches.remove(f)
            self._draining.append(f)  # its read may still land in its pages: freed on its result
        for n in list(self.tree.nodes()):
            kinds = {f.kind for f in n.flights}
            for f in n.flights:
                f.cancelled = True
            if n.value is not None and "h2d" not in kinds:
                self.device.free(n.value)
            if n.host_value is not None and "d2h" not in kinds:
                self.host.free(n.host_value)  # type: ignore[union-attr]
            n.flights = []
        self.tree.clear()
        self._l3_index.clear()
        self._backup_retry.clear()
        self.recorder.cleared()
        self._count("resets")

    @property
    def inflight(self) -> int:
        return len(self._ops) + len(self._prefetches)
