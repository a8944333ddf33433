"""The tiered KV cache a worker embeds: device (L1) / host (L2) / storage (L3) over one radix tree.

Semantics follow SGLang's HiRadixCache (write-through, selective write-through, write-back,
load-back, L3 backup and prefetch) with one deliberate difference: every `Stored` event is emitted
only after the copy that put the bytes on that tier has been acknowledged (design §3) — including
load-back, which SGLang announces at issue.

Threading: everything here runs on the scheduler thread. Copies run on the transfer engine, L3 I/O
on the storage worker; their acks are picked up by `step()` (SGLang's `writing_check` /
`loading_check`), which the engine calls once per scheduling step.

Tier invariants the eviction rules keep:
- device-resident nodes form a prefix-closed set (only device leaves are device-evicted);
- a device-less node keeps its host copy while a child still has a device or host copy;
- a node holding no tier ("hollow") stays only while it has children; a match stops before it.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from producer.allocator import PoolExhausted
from producer.components.base import DEVICE, HOST, STORAGE, Component, CompState
from producer.components.extra_pool import ExtraPool
from producer.components.full import FullAttention
from producer.events import EventRecorder
from producer.page_hash import DIGEST_LEN, fused_digest, page_hash_chain, page_hash_chain_blob
from producer.pools import KVPool
from producer.radix_tree import RadixTree, TreeNode
from producer.storage.base import backend_medium
from producer.storage.keys import page_key, split_key
from schemas.media import Medium

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    page_size: int
    write_policy: str = "write_through"
    write_through_threshold: int = 2          # hits before a selective write-through copies to host
    storage_backup: bool = True               # back host pages up to L3 once their host copy landed
    prefetch_threshold_tokens: int = 256      # prefetch only when L3 could add at least this many
    prefetch_timeout_base_s: float = 1.0
    prefetch_timeout_per_1k_tokens_s: float = 0.25
    storage_suffix: str | None = None         # L3 key suffix of this pool (extra pools differ)
    page_hash: str = "sha256"                 # "sha256" (SGLang-compatible ids) or "xxh3" (cheaper)
    component_events: bool = False            # also emit per-group events in vLLM's shape (docs/hybrid.md)

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if self.write_through_threshold < 1:
            raise ValueError("write_through_threshold must be >= 1")
        page_hash_chain(self.page_hash)  # fails early with a clear message


class Flight:
    """One in-flight operation and the nodes it concerns (splits add the new halves)."""

    __slots__ = ("kind", "nodes", "dst_pages", "lock_node", "cancelled", "deadline", "key", "start", "keys",
                 "pending", "failed", "kv", "parts", "comps", "npages")

    def __init__(self, kind: str, dst_pages: list[int] | None = None) -> None:
        self.pending = 0                  # copies (one per pool tensor) not yet acknowledged
        self.failed: str | None = None    # first failure among them: the whole flight fails
        self.kv = True                    # the node's KV (and extra pools) are part of it
        self.parts: list[tuple[Component, list[int]]] = []  # component slots it fills (freed if cancelled)
        self.comps: list[Component] = []  # components it carries (backup / prefetch)
        self.npages = 0
        self.kind = kind                  # "d2h" | "h2d" | "backup" | "prefetch"
        self.nodes: list[TreeNode] = []
        self.dst_pages = dst_pages or []
        self.lock_node: TreeNode | None = None
        self.cancelled = False
        self.deadline = 0.0
        self.key: tuple[int, ...] = ()
        self.start = 0
        self.keys: list[str] = []

    def attach(self, node: TreeNode) -> None:
        self.nodes.append(node)
        node.flights.append(self)

    def detach_all(self) -> None:
        for n in self.nodes:
            if self in n.flights:
                n.flights.remove(self)


class MatchResult:
    """What `match_prefix` found. Lengths are in tokens (whole pages only)."""

    __slots__ = ("device_pages", "device_len", "device_node", "host_node", "host_len",
                 "best_node", "best_len", "storage_len", "loading", "kv_len", "branch_len")

    def __init__(self) -> None:
        self.device_pages: list[int] = []
        self.device_len = 0
        self.device_node: TreeNode | None = None   # device anchor (root when nothing matched)
        self.host_node: TreeNode | None = None     # end of the host-backed run after the anchor
        self.host_len = 0                          # SGLang's host_hit_length
        self.best_node: TreeNode | None = None     # deepest usable node, L3-only ones allowed
        self.best_len = 0
        self.storage_len = 0                       # tokens only L3 holds, after the host run
        self.loading = False                       # some matched device pages are still loading
        self.kv_len = 0                            # hybrid: full-attention KV run on the device alone
        self.branch_len = 0                        # hybrid: Mamba branching point (0 = off), docs/hybrid.md

    def __repr__(self) -> str:
        return (f"MatchResult(device={self.device_len}, host={self.host_len}, storage={self.storage_len}, "
                f"best={self.best_len}, loading={self.loading})")


def _depth(node: TreeNode) -> int:
    d = 0
    while node.parent is not None:
        d += 1
        node = node.parent
    return d


class TieredCache:
    """Radix prefix cache over device / host / L3 tiers with acknowledged, medium-aware events.

    Device-only use (`host_pool=None`) is a plain radix cache with the same events."""

    def __init__(self, config: CacheConfig, device_pool: KVPool, host_pool: KVPool | None = None,
                 transfer: Any = None, storage: Any = None, recorder: EventRecorder | None = None,
                 *, validate: Callable[[TreeNode], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic,
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
        self.components: tuple[Component, ...] = tuple(components)
        self.extras: tuple[ExtraPool, ...] = tuple(extra_pools)
        self.full = full or FullAttention()
        self.hybrid = bool(self.components)  # extra pools alone keep full-attention match semantics
        self._grp = config.component_events
        self.config = config
        self.page_size = config.page_size
        self.device = device_pool
        self.host = host_pool
        self.transfer = transfer
        self.storage = storage
        self.l3_medium: Medium | None = backend_medium(storage.backend) if storage is not None else None
        self.recorder = recorder if recorder is not None else EventRecorder(None, enabled=False)
        self.validate = validate  # component seam: Mamba / sliding-window checks (later issue)
        self.clock = clock
        self.tree = RadixTree(config.page_size, split_hook=self._on_split,
                              chain=page_hash_chain(config.page_hash),
                              chain_blob=page_hash_chain_blob(config.page_hash),
                              digest_len=DIGEST_LEN[config.page_hash])
        # Whether a new node's hashing and store can be one native call (`Batch.stored_chain`).
        fused, digest_fn = fused_digest(config.page_hash)
        self._fused = fused
        # `Batch.stored_chain`'s per-tier arguments (the recorder is fixed at construction).
        grp, kind = self._grp, self.full.kind
        self._chain_specs: dict[Medium, tuple] = {
            m: (digest_fn, DIGEST_LEN[config.page_hash], self.page_size, self.page_size, self.recorder.names[m],
                0 if grp else None, kind if grp else None, None) for m in Medium}
        self.tick = 0  # logical LRU time
        self._ops: dict[int, Flight] = {}
        self._prefetches: list[Flight] = []
        self._backup_retry: deque[TreeNode] = deque()
        self._l3_index: dict[str, TreeNode] = {}
        self.stats: dict[str, int] = {}

    @staticmethod
    def _check_components(components: Sequence[Component], extras: Sequence[ExtraPool],
                          device: KVPool, host: KVPool | None) -> None:
        names: set[str] = set()
        groups: set[int] = set()
        suffixes: set[str] = set()
        for c in (*components, *extras):
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

    # ------------------------------------------------------------------------------------------
    # helpers

    def _count(self, what: str, n: int = 1) -> None:
        self.stats[what] = self.stats.get(what, 0) + n

    def _emit_stored(self, node: TreeNode, medium: Medium) -> None:
        rec = self.recorder
        if rec.enabled:
            tree = self.tree
            b = rec.batch
            if b is not None and node.digests is None and self._fused:
                # A new node: its pages are hashed and its store recorded in one native call (the
                # token ids are read once, docs/producer-events.md). What it declines is hashed
                # and recorded below, which raises what hashing raises.
                p = node.parent
                try:
                    node.digests = b.stored_chain(
                        node.key, None if p is tree.root or p is None else (p.digests or tree.ensure_digests(p)),
                        self._chain_specs[medium])
                    return
                except (TypeError, OverflowError, ValueError):
                    pass
            # The node's digests go to the recorder as they are: ids are read from them only when
            # the batch is built (docs/producer-events.md).
            if self._grp:
                rec.stored_digests(tree.ensure_digests(node), tree.dlen, tree.parent_id(node), node.key,
                                   self.page_size, medium, group_idx=0, kind=self.full.kind)
            else:
                rec.stored_digests(tree.ensure_digests(node), tree.dlen, tree.parent_id(node), node.key,
                                   self.page_size, medium)

    def _emit_removed(self, node: TreeNode, medium: Medium) -> None:
        rec = self.recorder
        if rec.enabled:
            tree = self.tree
            d = node.digests or tree.ensure_digests(node)
            b = rec.batch
            if b is not None:  # straight into the native batch (the recorder's own fast path)
                try:
                    b.removed_digests(d, tree.dlen, rec.names[medium], 0 if self._grp else None)
                    return
                except (TypeError, OverflowError):
                    pass
            rec.removed_digests(d, tree.dlen, medium, group_idx=0 if self._grp else None)

    def _comp_blocks(self, node: TreeNode, c: Component) -> tuple[list[int], int | None, tuple[int, ...]]:
        """(block ids, parent id, tokens) a component's state at `node` names: every page for
        per-page components; the last page only for a Mamba state (the block at whose end it sits)."""
        ids = self.tree.ensure_hashes(node)
        if c.per_page:
            return ids, self.tree.parent_id(node), node.key
        parent = ids[-2] if len(ids) > 1 else self.tree.parent_id(node)
        return ids[-1:], parent, node.key[-self.page_size:]

    def _emit_comp(self, node: TreeNode, c: Component, medium: Medium, stored: bool) -> None:
        rec = self.recorder
        if not (self._grp and rec.enabled):
            return  # default (SGLang-compatible): component-only changes are silent
        ids, parent, tokens = self._comp_blocks(node, c)
        if stored:
            rec.stored(ids, parent, tokens, self.page_size, medium, group_idx=c.group_idx, kind=c.kind,
                       window=c.window)
        else:
            rec.removed(ids, medium, group_idx=c.group_idx)

    def _comp_keys(self, node: TreeNode, c: Component) -> list[str]:
        d = self.tree.digest_list(node)
        return [page_key(x, c.suffix) for x in (d if c.per_page else d[-1:])]

    def _l3_keys(self, node: TreeNode) -> list[str]:
        """The node's KV keys, then each extra pool's (page hash + the pool's suffix)."""
        digests = self.tree.digest_list(node)
        suffix = self.config.storage_suffix
        keys = [page_key(d, suffix) for d in digests]
        for x in self.extras:
            keys += [page_key(d, x.suffix) for d in digests]
        return keys

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

    def _usable(self, node: TreeNode) -> bool:
        if node.hollow:
            return False
        return self.validate is None or self.validate(node)

    # ------------------------------------------------------------------------------------------
    # engine-facing API

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Longest cached prefix. `device_pages` are usable now (after `loading` clears); the host
        run can be loaded with `init_load_back`, the L3 run fetched with `prefetch`."""
        self.tick += 1
        key = self.tree.page_key(tokens)
        if self.hybrid:
            return self._match_hybrid(key)
        path, _ = self.tree.match(key, self.tick, self._usable)
        r = MatchResult()
        root = self.tree.root
        r.device_node = r.host_node = r.best_node = root
        i, n = 0, len(path)
        while i < n and path[i].value is not None:
            node = path[i]
            r.device_pages.extend(node.value)  # type: ignore[arg-type]
            r.device_len += len(node.key)
            r.loading |= not node.device_ready
            r.device_node = node
            i += 1
        r.host_node = r.device_node
        while i < n and path[i].host_value is not None and path[i].host_ready:
            r.host_node = path[i]
            r.host_len += len(path[i].key)
            i += 1
        r.best_node = r.host_node
        while i < n and path[i].stored:
            r.best_node = path[i]
            r.storage_len += len(path[i].key)
            i += 1
        r.best_len = r.device_len + r.host_len + r.storage_len
        return r

    # -- hybrid match (docs/hybrid.md "Match semantics") ----------------------------------------
    def _kv_on(self, n: TreeNode, tier: int) -> bool:
        if tier == DEVICE:
            return n.value is not None and n.device_ready
        if tier == HOST:
            return n.host_value is not None and n.host_ready
        return n.stored

    def usable_pages(self, path: Sequence[TreeNode]) -> tuple[int, int, int, int]:
        """Usable prefix lengths in pages along `path` from the root, on acknowledged bytes only:
        (device alone, device+host, any tier, full-attention KV on the device alone). A length L
        is usable when every page [0, L) has its KV on an allowed tier and every component
        validates an end at L (vLLM's rule; L = 0 always)."""
        tiers_of = ((DEVICE,), (DEVICE, HOST), (DEVICE, HOST, STORAGE))
        npages = [len(n.key) // self.page_size for n in path]
        out = []
        kv_dev = 0
        for m, tiers in enumerate(tiers_of):
            kv = 0
            for n, k in zip(path, npages):
                if not any(self._kv_on(n, t) for t in tiers):
                    break
                kv += k
            if m == 0:
                kv_dev = kv
            checks = []
            for c in self.components:
                ok: list[bool] = []
                ends: list[bool] = []
                for n, k in zip(path, npages):
                    st = self._state(n, c)
                    on = st is not None and any(st.on(t) for t in tiers)
                    ok.extend([on] * k)
                    ends.extend([False] * (k - 1) + [on and not c.per_page])
                checks.append((c, ends, ok))
            L = kv
            while L > 0 and not all(c.valid_end(e, o, L) for c, e, o in checks):
                L -= 1
            out.append(L)
        return out[0], out[1], out[2], kv_dev

    def _node_ending_at(self, key: tuple[int, ...], length: int) -> TreeNode:
        """The node whose path ends exactly `length` tokens into `key` (splitting one if needed)."""
        node = self.tree.root
        i = 0
        ck = self.tree._ck
        while i < length:
            child = node.children[ck(key, i)]
            if i + len(child.key) > length:
                child = self.tree.split(child, length - i)
            i += len(child.key)
            node = child
        return node

    def _match_hybrid(self, key: tuple[int, ...]) -> MatchResult:
        path, _ = self.tree.match(key, self.tick, self._usable)
        p = self.page_size
        dev, host, best, kv_dev = self.usable_pages(path)
        r = MatchResult()
        r.device_node = self._node_ending_at(key, dev * p)
        r.host_node = self._node_ending_at(key, host * p)
        r.best_node = self._node_ending_at(key, best * p)
        r.device_pages = self.device_pages_of(r.device_node)
        r.device_len = dev * p
        r.host_len = (host - dev) * p
        r.storage_len = (best - host) * p
        r.best_len = best * p
        r.kv_len = kv_dev * p
        # Mamba branching: the KV runs past the last usable state, so the engine may checkpoint a
        # new state there while it recomputes. Off when the match relies on host-backed state.
        if kv_dev > dev and best == dev and any(not c.per_page for c in self.components):
            r.branch_len = kv_dev * p
        return r

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
                self._emit_stored(node, Medium.GPU)
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
                        self._emit_comp(node, c, Medium.GPU, True)
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
                        self._emit_comp(node, c, Medium.GPU, True)
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
            kv_total = sum(len(x.host_value) for x, kv, _ in items if kv)  # type: ignore[arg-type]
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

    def _store_knows(self) -> Callable[[list[str]], list[bool]] | None:
        """What the L3 backend itself knows it holds, when its contents are local (a node-local
        store keeps an index of its keys); None for a shared store other workers write to."""
        backend = self.storage.backend
        knows = getattr(backend, "knows", None)
        if backend.shared or knows is None:
            return None
        return knows  # type: ignore[no-any-return]

    def _page_keys(self, digests: Sequence[bytes]) -> list[list[str]]:
        """L3 keys per pool for these pages: KV, each extra pool, each component (per page)."""
        out = [[page_key(d, self.config.storage_suffix) for d in digests]]
        out += [[page_key(d, x.suffix) for d in digests] for x in self.extras]
        out += [[page_key(d, c.suffix) for d in digests] for c in self.components]
        return out

    def prefetch(self, tokens: Sequence[int], match: MatchResult | None = None, now: float | None = None) -> bool:
        """Fetch L3 pages beyond the host run of the match into host memory (asynchronously).

        With a node-local store the backend knows what it holds: only the run of pages it holds
        for every pool is fetched, and only when that run is at least `prefetch_threshold_tokens`.
        With a shared store (contents unknown) host pages for the whole remainder are reserved
        first, as SGLang does (docs/hybrid.md "Prefetch"). Abandoned after base + per-1k-tokens
        seconds. Returns whether a fetch was issued."""
        if self.storage is None or self.host is None:
            return False
        key = self.tree.page_key(tokens)
        if match is None:
            match = self.match_prefix(tokens)
        anchor = match.host_node or self.tree.root
        if anchor.parent is None and anchor is not self.tree.root:
            return False
        start = match.device_len + match.host_len
        p = self.page_size
        npages = (len(key) - start) // p
        if npages <= 0 or npages * p < self.config.prefetch_threshold_tokens:
            return False
        if any(f.start == start and f.key[:start + p] == key[:start + p] for f in self._prefetches):
            return False  # this continuation is already on its way
        prior = None
        if anchor is not self.tree.root:
            prior = self.tree.last_digest(anchor)
        digests = self.tree.chain(key[start:start + npages * p], p, prior)
        knows = self._store_knows()
        if knows is not None:
            blocks = self._page_keys(digests)[:1 + len(self.extras)]  # the KV and what travels with it
            flags = knows([k for b in blocks for k in b])
            held = 0
            while held < npages and all(flags[b * npages + held] for b in range(len(blocks))):
                held += 1
            if held * p < self.config.prefetch_threshold_tokens:
                self._count("prefetch_not_held")
                return False
            npages = held
        f = Flight("prefetch")
        # Protect the anchor path first (host-only nodes by host refs, the device part by a lock):
        # the host eviction below must not take the very prefix the fetched pages hang from.
        n = anchor
        while n is not self.tree.root and n.value is None:
            n.host_ref += 1
            f.attach(n)
            n = n.parent  # type: ignore[assignment]
        if n is not self.tree.root:
            self.tree.inc_lock(n)
            f.lock_node = n
        short = npages - self.host.allocator.available
        if short > 0:
            self.evict_host(short)
        npages = min(npages, self.host.allocator.available)
        if npages <= 0:
            self._release_prefetch(f)
            self._count("prefetch_no_host_memory")
            return False
        hp = self.host.alloc(npages)
        f.dst_pages = hp
        f.npages = npages
        f.comps = list(self.components)
        end = start + npages * p
        keys = [k for b in self._page_keys(digests[:npages]) for k in b]
        f.key = key[:end]
        f.start = start
        f.keys = keys
        now = self.clock() if now is None else now
        f.deadline = (now + self.config.prefetch_timeout_base_s
                      + self.config.prefetch_timeout_per_1k_tokens_s * (end - start) / 1000.0)
        if not self.storage.submit_get(keys, f):
            self._release_prefetch(f)
            self.host.free(hp)
            self._count("prefetch_rejected")
            return False
        self._prefetches.append(f)
        self._count("prefetch_issued")
        return True

    def lock(self, node: TreeNode) -> None:
        """Keep `node` and its ancestors on the device (a request is using them)."""
        if node is not self.tree.root:
            self.tree.inc_lock(node)

    def unlock(self, node: TreeNode) -> None:
        if node is not self.tree.root:
            self.tree.dec_lock(node)

    def device_pages_of(self, node: TreeNode) -> list[int]:
        parts = []
        while node is not self.tree.root and node is not None:
            parts.append(node.value or [])
            node = node.parent  # type: ignore[assignment]
        return [p for part in reversed(parts) for p in part]

    def is_loaded(self, node: TreeNode) -> bool:
        """True when every page on the path to `node` has landed on the device."""
        while node is not self.tree.root and node is not None:
            if node.value is None or not node.device_ready:
                return False
            node = node.parent  # type: ignore[assignment]
        return True

    # ------------------------------------------------------------------------------------------
    # allocation and eviction

    def alloc_device(self, n: int) -> list[int]:
        """Device pages for new KV, evicting LRU device pages if needed (PoolExhausted if not)."""
        short = n - self.device.allocator.available
        if short > 0:
            self.evict(short)
        return self.device.alloc(n)

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

    def _alloc_host(self, n: int) -> list[int]:
        short = n - self.host.allocator.available  # type: ignore[union-attr]
        if short > 0:
            self.evict_host(short)
        return self.host.alloc(n)  # type: ignore[union-attr]

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
            self._emit_comp(n, c, medium, False)
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
                    self._emit_comp(n, c, medium, False)
                c.device.free(st.dev)
                st.dev, st.dev_ready = None, False
            elif tier == HOST and st.host is not None:
                if st.host_ready:
                    self._emit_comp(n, c, medium, False)
                c.pool(HOST).free(st.host)
                st.host, st.host_ready = None, False
            self._clean_state(n, c)

    # -- releasing a tier's pages (the caller emits the event, if any) --------------------------
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
                st = self._state(n, c)
                if st is not None and st.stored:
                    st.stored = False
                    for k in self._comp_keys(n, c):
                        self._l3_index.pop(k, None)
                    self._emit_comp(n, c, self.l3_medium, False)  # type: ignore[arg-type]
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
            self._emit_removed(n, Medium.GPU)
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
            self._emit_removed(n, Medium.CPU_PINNED)
            self._count("host_evicted_pages", k)
            self._prune_if_empty(n)
            return k

        return self.tree.evict_lru(num_pages, self._host_candidate, evict_one)

    # ------------------------------------------------------------------------------------------
    # copies between tiers (docs/hybrid.md "Atomic tiers": one flight per node carries the KV,
    # every extra pool and the node's component states; it lands, or fails, as a whole)

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

    def _backup_to_storage(self, node: TreeNode) -> None:
        """Host → L3 for a node whose host copy has landed: its KV, extra pools and host component
        states in one batch; the host pages stay protected until the backend confirms every key
        (`Stored(DISK|EXTERNAL)` then — for all of them, or for none)."""
        if (self.storage is None or not self.config.storage_backup or node.stored or node.parent is None
                or node.host_value is None or not node.host_ready
                or any(f.kind == "backup" for f in node.flights)):
            return
        keys = self._l3_keys(node)
        host = self.host
        hv = node.host_value
        values = [host.page_to_bytes(p) for p in hv]  # type: ignore[union-attr]
        for x in self.extras:
            values += [x.page_to_bytes(p, True) for p in hv]
        f = Flight("backup")
        for c in self.components:
            st = self._state(node, c)
            if st is not None and st.on(HOST):
                keys += self._comp_keys(node, c)
                values += [c.pool(HOST).slot_to_bytes(s) for s in st.host]  # type: ignore[union-attr]
                f.comps.append(c)
        f.keys = keys
        if not self.storage.submit_set(keys, values, f):
            self._backup_retry.append(node)
            self._count("backup_deferred")
            return
        node.host_ref += 1
        f.attach(node)
        self._count("backup_issued_pages", len(hv))

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
        nodes = sorted(f.nodes, key=_depth)  # parents first: events chain from known blocks
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
                self._emit_stored(n, medium)
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
            self._emit_comp(n, c, medium, True)
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

    def _release_prefetch(self, f: Flight) -> None:
        for n in f.nodes:
            n.host_ref -= 1
        f.detach_all()
        f.nodes = []
        if f.lock_node is not None:
            self.tree.dec_lock(f.lock_node)
            f.lock_node = None
        if f in self._prefetches:
            self._prefetches.remove(f)

    def _finish_prefetch(self, f: Flight, values: list[bytes | None] | None) -> None:
        if f.cancelled:
            return  # timed out or reset: its host pages were already returned
        self._release_prefetch(f)
        host = self.host
        assert host is not None
        npg = f.npages
        vals = list(values or [])
        if len(vals) != len(f.keys):
            vals = [None] * len(f.keys)
        nx = len(self.extras)

        def blk(b: int) -> list[bytes | None]:
            return vals[b * npg:(b + 1) * npg]

        kvv, xv = blk(0), [blk(1 + i) for i in range(nx)]
        # a page is usable only when the KV and every extra pool came back whole
        k = 0
        for j in range(npg):
            v = kvv[j]
            if (v is None or len(v) != host.page_bytes
                    or any(xx[j] is None or len(xx[j]) != x.page_bytes() for x, xx in zip(self.extras, xv))):  # type: ignore[arg-type]
                if v is not None or any(xx[j] is not None for xx in xv):
                    self._count("prefetch_bad_value")
                break
            k += 1
        hp = f.dst_pages
        for j, page in enumerate(hp[:k]):
            host.page_from_bytes(page, kvv[j])  # type: ignore[arg-type]
            for x, xx in zip(self.extras, xv):
                x.page_from_bytes(page, xx[j], True)  # type: ignore[arg-type]
        if k < len(hp):
            host.free(hp[k:])
        if k == 0:
            return
        p = self.page_size
        self.tick += 1
        kk = f.key[:f.start + k * p]
        path, _ = self.tree.insert_path(kk, self.tick)
        cvals = {c.name: blk(1 + nx + i) for i, c in enumerate(f.comps)}

        def whole(c: Component, v: bytes | None) -> bool:
            return v is not None and len(v) == c.pool(HOST).slot_bytes

        if path[0][1] <= f.start and any(not c.per_page for c in f.comps):
            for c in f.comps:  # a Mamba state sits at a node's end: make those ends exist
                if not c.per_page:
                    for j in range(k):
                        if whole(c, cvals[c.name][j]):
                            self._node_ending_at(kk, f.start + (j + 1) * p)
            path, _ = self.tree.insert_path(kk, self.tick)
        got: list[tuple[TreeNode, int]] = []
        spare: list[int] = []
        for node, off in path:
            if off < f.start:
                if off + len(node.key) > f.start:  # cannot happen while the anchor is protected
                    self._count("prefetch_misaligned")
                    spare.extend(hp[:k])
                    got = []
                    break
                continue
            a = (off - f.start) // p
            pg = hp[a:a + len(node.key) // p]
            if node.host_value is not None:
                spare.extend(pg)  # someone else put it on the host meanwhile
                continue
            node.host_value = pg
            node.host_ready = True
            got.append((node, a))
        if spare:
            host.free(spare)
        landed: list[tuple[TreeNode, Component]] = []
        for node, a in got:  # each component lands with its node's KV, whole or not at all
            kp = len(node.key) // p
            for c in f.comps:
                vs = cvals[c.name][a:a + kp] if c.per_page else cvals[c.name][a + kp - 1:a + kp]
                if not vs or not all(whole(c, v) for v in vs):
                    continue
                try:
                    sl = self._alloc_comp(c, HOST, len(vs))
                except PoolExhausted:
                    self._count("prefetch_no_component_memory")
                    continue
                for s, v in zip(sl, vs):
                    c.pool(HOST).slot_from_bytes(s, v)  # type: ignore[arg-type]
                st = self._new_state(node, c)
                st.host, st.host_ready = sl, True
                landed.append((node, c))
        nodes = [n for n, _ in got]
        for node in nodes:
            self._emit_stored(node, Medium.CPU_PINNED)
        for node, c in landed:
            self._emit_comp(node, c, Medium.CPU_PINNED, True)
        for node in nodes:
            if not node.stored:  # the bytes were just read from L3: they are there
                node.stored = True
                for key in self._l3_keys(node):
                    self._l3_index[key] = node
                self._emit_stored(node, self.l3_medium)  # type: ignore[arg-type]
        for node, c in landed:
            st = self._state(node, c)
            if st is not None and not st.stored:
                st.stored = True
                for key in self._comp_keys(node, c):
                    self._l3_index[key] = node
                self._emit_comp(node, c, self.l3_medium, True)  # type: ignore[arg-type]
        self._count("prefetch_pages", k)

    def _finish_backup(self, f: Flight, keys: list[str], ok: list[bool]) -> None:
        if f.cancelled:
            return
        okmap = dict(zip(keys, ok))
        nodes = sorted(f.nodes, key=_depth)
        f.detach_all()
        landed: list[tuple[TreeNode, Component, list[str]]] = []
        for n in nodes:
            n.host_ref -= 1
            nkeys = self._l3_keys(n)
            ckeys = [(c, self._comp_keys(n, c)) for c in f.comps if self._state(n, c) is not None]
            if all(okmap.get(k, False) for k in nkeys) and all(okmap.get(k, False) for _, ks in ckeys for k in ks):
                if not n.stored and n.parent is not None:
                    n.stored = True
                    for k in nkeys:
                        self._l3_index[k] = n
                    self._emit_stored(n, self.l3_medium)  # type: ignore[arg-type]
                if n.stored:
                    landed += [(n, c, ks) for c, ks in ckeys]
            else:
                self._count("backup_failed_nodes")  # all or nothing: no part of it is claimed
        for n, c, ks in landed:
            st = self._state(n, c)
            if st is not None and not st.stored:
                st.stored = True
                for k in ks:
                    self._l3_index[k] = n
                self._emit_comp(n, c, self.l3_medium, True)  # type: ignore[arg-type]

    def _forget_l3(self, keys: list[str]) -> None:
        by_suffix = {c.suffix: c for c in self.components}
        for k in keys:
            n = self._l3_index.get(k)
            if n is None:
                continue
            comp = by_suffix.get(split_key(k)[1])  # type: ignore[arg-type]
            for c in self.components:
                if comp is not None and c is not comp:
                    continue  # a component key breaks only that component's copy
                st = self._state(n, c)
                if st is not None and st.stored:
                    st.stored = False
                    for kk in self._comp_keys(n, c):
                        self._l3_index.pop(kk, None)
                    self._emit_comp(n, c, self.l3_medium, False)  # type: ignore[arg-type]
                    self._clean_state(n, c)
            if comp is not None:
                self._l3_index.pop(k, None)
                continue
            # One page (of any pool) gone breaks the node's L3 copy: un-claim all of it.
            for kk in self._l3_keys(n):
                self._l3_index.pop(kk, None)
            if n.stored:
                n.stored = False
                self._emit_removed(n, self.l3_medium)  # type: ignore[arg-type]
                self._count("l3_evicted_nodes")
            self._prune_if_empty(n)

    # ------------------------------------------------------------------------------------------
    # the per-step pump

    def step(self, now: float | None = None) -> None:
        """Observe finished copies and storage results, expire prefetches, send events."""
        now = self.clock() if now is None else now
        if self.transfer is not None:
            self._apply_completions(self.transfer.poll())
        if self.storage is not None:
            # Evictions first, results second, applied results-then-evictions: a key's set result
            # always precedes its eviction notice, so no eviction is applied before its store.
            evicted = self.storage.drain_evicted()
            for r in self.storage.poll():
                tag = r.tag
                if not isinstance(tag, Flight):
                    continue
                if r.op == "set":
                    self._finish_backup(tag, r.keys, r.ok)
                elif r.op == "get":
                    self._finish_prefetch(tag, r.values)
            if evicted:
                self._forget_l3(evicted)
            for f in list(self._prefetches):
                if now > f.deadline:
                    f.cancelled = True
                    self._release_prefetch(f)
                    self.host.free(f.dst_pages)  # type: ignore[union-attr]
                    self._count("prefetch_timeouts")
            for _ in range(len(self._backup_retry)):
                node = self._backup_retry.popleft()
                self._backup_to_storage(node)
        if self.recorder.snapshot_requested():
            self.recorder.flush(now)  # what happened so far goes first: the snapshot batch starts with the clear
            self.emit_snapshot()
        self.recorder.flush(now)

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
                self._emit_stored(n, Medium.GPU)
            if n.host_value is not None and n.host_ready:
                self._emit_stored(n, Medium.CPU_PINNED)
            if n.stored and l3 is not None:
                self._emit_stored(n, l3)
            for c in self.components:
                st = self._state(n, c)
                if st is None:
                    continue
                for tier, medium in ((DEVICE, Medium.GPU), (HOST, Medium.CPU_PINNED), (STORAGE, l3)):
                    if st.on(tier) and medium is not None:
                        self._emit_comp(n, c, medium, True)
        self._count("snapshots")

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

    # SGLang's names for the ack polling done by step()
    writing_check = step
    loading_check = step

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
            self.host.free(f.dst_pages)  # type: ignore[union-attr]
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

    # ------------------------------------------------------------------------------------------
    # introspection (tests, metrics)

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
                ids = self._comp_blocks(n, c)[0]
                for tier, medium in ((DEVICE, Medium.GPU), (HOST, Medium.CPU_PINNED), (STORAGE, l3)):
                    if st.on(tier) and medium is not None:
                        out.update((c.group_idx, i, medium) for i in ids)
        return out

    @property
    def inflight(self) -> int:
        return len(self._ops) + len(self._prefetches)

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
        for f in self._prefetches:
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
