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
from producer.events import EventRecorder
from producer.page_hash import page_hash_chain
from producer.pools import KVPool
from producer.radix_tree import RadixTree, TreeNode
from producer.storage.base import backend_medium
from producer.storage.keys import page_key
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

    __slots__ = ("kind", "nodes", "dst_pages", "lock_node", "cancelled", "deadline", "key", "start", "keys")

    def __init__(self, kind: str, dst_pages: list[int] | None = None) -> None:
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
                 "best_node", "best_len", "storage_len", "loading")

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
                 clock: Callable[[], float] = time.monotonic) -> None:
        if device_pool.page_size != config.page_size:
            raise ValueError(f"device pool page size {device_pool.page_size} != cache page size {config.page_size}")
        if host_pool is not None:
            if transfer is None:
                raise ValueError("a host tier needs a transfer engine")
            if host_pool.page_shape != device_pool.page_shape or host_pool.buffer.dtype != device_pool.buffer.dtype:
                raise ValueError("host and device pools must have the same page shape and dtype")
        if storage is not None and host_pool is None:
            raise ValueError("L3 storage needs a host tier (backups and prefetches go through host memory)")
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
                              chain=page_hash_chain(config.page_hash))
        self.tick = 0  # logical LRU time
        self._ops: dict[int, Flight] = {}
        self._prefetches: list[Flight] = []
        self._backup_retry: deque[TreeNode] = deque()
        self._l3_index: dict[str, TreeNode] = {}
        self.stats: dict[str, int] = {}

    # ------------------------------------------------------------------------------------------
    # helpers

    def _count(self, what: str, n: int = 1) -> None:
        self.stats[what] = self.stats.get(what, 0) + n

    def _emit_stored(self, node: TreeNode, medium: Medium) -> None:
        rec = self.recorder
        if rec.enabled:
            tree = self.tree
            rec.stored(tree.ensure_hashes(node), tree.parent_id(node), node.key, self.page_size, medium)

    def _emit_removed(self, node: TreeNode, medium: Medium) -> None:
        if self.recorder.enabled:
            self.recorder.removed(self.tree.ensure_hashes(node), medium)

    def _l3_keys(self, node: TreeNode) -> list[str]:
        self.tree.ensure_hashes(node)
        suffix = self.config.storage_suffix
        return [page_key(d, suffix) for d in node.digests]  # type: ignore[union-attr]

    def _on_split(self, new: TreeNode, child: TreeNode) -> None:
        # Bookkeeping that names `child` must now also name its new prefix half.
        for f in child.flights:
            f.attach(new)
        if new.stored and new.digests is not None:
            for k in self._l3_keys(new):
                self._l3_index[k] = new
        if child.components is not None:  # component state splitting arrives with components
            new.components = None

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

    def insert(self, tokens: Sequence[int], device_pages: Sequence[int]) -> int:
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
        # after the walk: host allocation may evict host copies of nodes on this very path
        for node in backup:
            self._write_backup(node)
        return prefix

    def init_load_back(self, match: MatchResult, mem_quota_pages: int | None = None) -> tuple[list[int], TreeNode]:
        """Start host → device copies for the host run of `match`. Returns the device pages of the
        prefix (loading ones included) and the new device anchor. The loaded nodes are locked
        until their copies land; `Stored(GPU)` is emitted then."""
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
            op = self.transfer.submit(self.host.buffer, x.host_value, self.device.buffer, pg, f)
            self._ops[op] = f
        self.tree.dec_lock(chosen[-1])
        self._count("load_back_pages", total)
        return self.device_pages_of(chosen[-1]), chosen[-1]

    def prefetch(self, tokens: Sequence[int], match: MatchResult | None = None, now: float | None = None) -> bool:
        """Fetch L3 pages beyond the host run of the match into host memory (asynchronously). Only
        when at least `prefetch_threshold_tokens` could be gained; abandoned after
        base + per-1k-tokens seconds. Returns whether a fetch was issued."""
        if self.storage is None or self.host is None:
            return False
        key = self.tree.page_key(tokens)
        if match is None:
            match = self.match_prefix(tokens)
        anchor = match.host_node or self.tree.root
        if anchor.parent is None and anchor is not self.tree.root:
            return False
        start = match.device_len + match.host_len
        npages = (len(key) - start) // self.page_size
        if npages <= 0 or npages * self.page_size < self.config.prefetch_threshold_tokens:
            return False
        p = self.page_size
        if any(f.start == start and f.key[:start + p] == key[:start + p] for f in self._prefetches):
            return False  # this continuation is already on its way
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
        end = start + npages * self.page_size
        prior = None
        if anchor is not self.tree.root:
            self.tree.ensure_hashes(anchor)
            prior = anchor.digests[-1]  # type: ignore[index]
        suffix = self.config.storage_suffix
        keys = [page_key(d, suffix) for d in self.tree.chain(key[start:end], self.page_size, prior)]
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

    def _alloc_host(self, n: int) -> list[int]:
        short = n - self.host.allocator.available  # type: ignore[union-attr]
        if short > 0:
            self.evict_host(short)
        return self.host.alloc(n)  # type: ignore[union-attr]

    # -- releasing a tier's pages (the caller emits the event, if any) --------------------------
    def _free_device(self, n: TreeNode) -> int:
        k = len(n.value)  # type: ignore[arg-type]
        self.device.free(n.value)  # type: ignore[arg-type]
        n.value = None
        n.device_ready = False
        return k

    def _free_host(self, n: TreeNode) -> int:
        k = len(n.host_value)  # type: ignore[arg-type]
        self.host.free(n.host_value)  # type: ignore[union-attr, arg-type]
        n.host_value = None
        n.host_ready = False
        return k

    def _prune_if_empty(self, n: TreeNode) -> None:
        """A node no tier holds any more and with no children leaves the tree."""
        if n.hollow and not n.children and n.parent is not None:
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
    # copies between tiers

    def _write_backup(self, node: TreeNode) -> bool:
        """Start a device → host copy of `node`. `Stored(CPU_PINNED)` waits for its ack."""
        if self.host is None or node.host_value is not None or node.value is None or not node.device_ready:
            return False
        try:
            hp = self._alloc_host(len(node.value))
        except PoolExhausted:
            self._count("write_backup_no_host_memory")
            return False
        node.host_value = hp
        node.host_ready = False
        f = Flight("d2h", hp)
        f.attach(node)
        f.lock_node = node
        self.tree.inc_lock(node)  # the source pages must stay put until the copy lands
        op = self.transfer.submit(self.device.buffer, node.value, self.host.buffer, hp, f)
        self._ops[op] = f
        self._count("write_backup_pages", len(hp))
        return True

    def _backup_to_storage(self, node: TreeNode) -> None:
        """Host → L3 for a node whose host copy has landed; the host pages stay protected until
        the backend confirms (`Stored(DISK|EXTERNAL)` then)."""
        if (self.storage is None or not self.config.storage_backup or node.stored or node.parent is None
                or node.host_value is None or not node.host_ready
                or any(f.kind == "backup" for f in node.flights)):
            return
        keys = self._l3_keys(node)
        host = self.host
        values = [host.page_to_bytes(p) for p in node.host_value]  # type: ignore[union-attr]
        f = Flight("backup")
        f.keys = keys
        if not self.storage.submit_set(keys, values, f):
            self._backup_retry.append(node)
            self._count("backup_deferred")
            return
        node.host_ref += 1
        f.attach(node)
        self._count("backup_issued_pages", len(keys))

    def _finish_copy(self, f: Flight) -> None:
        if f.cancelled:
            pool = self.host if f.kind == "d2h" else self.device
            pool.free(f.dst_pages)  # type: ignore[union-attr]
            return
        nodes = sorted(f.nodes, key=_depth)  # parents first: events chain from known blocks
        f.detach_all()
        if f.kind == "d2h":
            for n in nodes:
                n.host_ready = True
                self._emit_stored(n, Medium.CPU_PINNED)
            self.tree.dec_lock(f.lock_node)  # type: ignore[arg-type]
            for n in nodes:
                self._backup_to_storage(n)
        else:  # h2d load-back
            for n in nodes:
                n.device_ready = True
                n.host_ref -= 1
                self._emit_stored(n, Medium.GPU)
            self.tree.dec_lock(f.lock_node)  # type: ignore[arg-type]

    def _fail_copy(self, f: Flight, reason: str) -> None:
        self._count(f"copy_failed_{f.kind}")
        log.error("%s copy failed: %s", f.kind, reason)
        if f.cancelled:
            (self.host if f.kind == "d2h" else self.device).free(f.dst_pages)  # type: ignore[union-attr]
            return
        nodes = list(f.nodes)
        f.detach_all()
        for n in nodes:
            if f.kind == "d2h":
                self._free_host(n)
            else:
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
        k = 0
        for v in values or []:
            if v is None or len(v) != host.page_bytes:
                if v is not None:
                    self._count("prefetch_bad_value")
                break
            k += 1
        hp = f.dst_pages
        for page, v in zip(hp[:k], values or []):
            host.page_from_bytes(page, v)  # type: ignore[arg-type]
        if k < len(hp):
            host.free(hp[k:])
        if k == 0:
            return
        p = self.page_size
        self.tick += 1
        path, _ = self.tree.insert_path(f.key[:f.start + k * p], self.tick)
        got: list[TreeNode] = []
        spare: list[int] = []
        for node, off in path:
            if off < f.start:
                if off + len(node.key) > f.start:  # cannot happen while the anchor is protected
                    self._count("prefetch_misaligned")
                    spare.extend(hp[:k])
                    break
                continue
            a = (off - f.start) // p
            pg = hp[a:a + len(node.key) // p]
            if node.host_value is not None:
                spare.extend(pg)  # someone else put it on the host meanwhile
                continue
            node.host_value = pg
            node.host_ready = True
            got.append(node)
        if spare:
            host.free(spare)
        for node in got:
            self._emit_stored(node, Medium.CPU_PINNED)
        for node in got:
            if not node.stored:  # the bytes were just read from L3: they are there
                node.stored = True
                for key in self._l3_keys(node):
                    self._l3_index[key] = node
                self._emit_stored(node, self.l3_medium)  # type: ignore[arg-type]
        self._count("prefetch_pages", k)

    def _finish_backup(self, f: Flight, keys: list[str], ok: list[bool]) -> None:
        if f.cancelled:
            return
        okmap = dict(zip(keys, ok))
        nodes = sorted(f.nodes, key=_depth)
        f.detach_all()
        for n in nodes:
            n.host_ref -= 1
            nkeys = self._l3_keys(n)
            if all(okmap.get(k, False) for k in nkeys):
                if not n.stored and n.parent is not None:
                    n.stored = True
                    for k in nkeys:
                        self._l3_index[k] = n
                    self._emit_stored(n, self.l3_medium)  # type: ignore[arg-type]
            else:
                self._count("backup_failed_nodes")

    def _forget_l3(self, keys: list[str]) -> None:
        for k in keys:
            n = self._l3_index.get(k)
            if n is None:
                continue
            # One page gone breaks the node's L3 copy: un-claim all of it (never over-claim).
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
        self._count("snapshots")

    def _apply_completions(self, done: list[tuple[int, object]]) -> None:
        for op, _tag in done:
            f = self._ops.pop(op, None)
            if f is not None:
                self._finish_copy(f)
        for op, _tag, reason in self.transfer.poll_failed():
            f = self._ops.pop(op, None)
            if f is not None:
                self._fail_copy(f, reason)

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
        for f in self._ops.values():
            if f.cancelled:
                (host_owned if f.kind == "d2h" else dev_owned).extend(f.dst_pages)
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
