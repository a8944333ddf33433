"""The producer's radix tree of KV pages: match / insert / split / LRU eviction and lock refs.

A plain data structure: no threads, no clocks, no torch. Keys are token tuples whose length is a
multiple of `page_size`; a partial trailing page is never part of a key. Each node carries the
per-tier state the tiered controller (`producer.cache`) manages; the tree only knows how to split
it (page-indexed lists split at the page boundary, everything else is copied) and calls a
`split_hook` so the controller can re-home bookkeeping that names the node (in-flight copies,
L3 key index, component state). LRU time is a logical counter the caller passes in.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence

from producer.page_hash import DIGEST_LEN, ChainBlob, chain_digests, ids_of, page_hash_chain_blob


class TreeNode:
    __slots__ = (
        "nid", "parent", "children", "key",
        "value", "device_ready",          # device pages; False while a load-back copy is in flight
        "host_value", "host_ready",       # host pages; False while the D2H copy is in flight
        "stored",                         # every page confirmed written to L3
        "lock_ref", "host_ref",           # device lock (propagates to root) / host protection (this node)
        "last_access", "hit_count",
        "digests",                        # the page chain's digests, concatenated; computed lazily
        "flights",                        # in-flight operations naming this node (controller-owned)
        "components",                     # hybrid models: component name -> CompState (producer/components)
    )

    def __init__(self, nid: int, parent: TreeNode | None, key: tuple[int, ...]) -> None:
        self.nid = nid
        self.parent = parent
        self.children: dict[object, TreeNode] = {}
        self.key = key
        self.value: list[int] | None = None
        self.device_ready = False
        self.host_value: list[int] | None = None
        self.host_ready = False
        self.stored = False
        self.lock_ref = 0
        self.host_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.digests: bytes | None = None
        self.flights: list = []
        self.components: dict | None = None

    @property
    def evicted(self) -> bool:
        """No device copy (SGLang's term)."""
        return self.value is None

    @property
    def hollow(self) -> bool:
        """Holds no tier at all: kept only while it still has children."""
        return self.value is None and self.host_value is None and not self.stored

    def __repr__(self) -> str:
        return (f"TreeNode(#{self.nid}, len={len(self.key)}, dev={self.value is not None}"
                f"{'' if self.device_ready else '*'}, host={self.host_value is not None}"
                f"{'' if self.host_ready else '*'}, l3={self.stored}, lock={self.lock_ref})")


SplitHook = Callable[[TreeNode, TreeNode], None]  # (new_parent, child)
Validate = Callable[[TreeNode], bool]


class RadixTree:
    __slots__ = ("page_size", "root", "_ids", "split_hook", "_ck", "chain", "chain_blob", "dlen")

    def __init__(self, page_size: int, split_hook: SplitHook | None = None,
                 chain: Callable[..., list[bytes]] = chain_digests, chain_blob: ChainBlob | None = None,
                 digest_len: int = DIGEST_LEN["sha256"]) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self._ids = itertools.count(1)
        self.root = TreeNode(0, None, ())
        self.root.lock_ref = 1  # the root is never evicted
        self.split_hook = split_hook
        # Page-hash chain functions (producer.page_hash): a list of digests (prefetch, L3 keys of
        # tokens not in the tree), and the concatenated digests a node keeps (one call and one
        # object per node; event ids are read from them when needed, docs/producer-events.md).
        self.chain = chain
        self.chain_blob = chain_blob if chain_blob is not None else page_hash_chain_blob("sha256")
        self.dlen = digest_len
        # Child key: the first page. With page size 1 the bare token is cheaper than a 1-tuple.
        p = page_size
        self._ck: Callable[[tuple[int, ...], int], object] = (
            (lambda key, i: key[i]) if p == 1 else (lambda key, i: key[i:i + p]))

    # -- keys ----------------------------------------------------------------------------------
    def page_key(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """Tokens truncated to whole pages, as a tuple (the tree's key type)."""
        n = len(tokens) - len(tokens) % self.page_size
        return tuple(tokens[:n])

    def _common(self, node_key: tuple[int, ...], key: tuple[int, ...], i: int) -> int:
        m = min(len(node_key), len(key) - i)
        if node_key[:m] == key[i:i + m]:  # fast path: C-level compare of the whole overlap
            return m
        p = self.page_size
        j = 0
        while j < m and node_key[j:j + p] == key[i + j:i + j + p]:
            j += p
        return j

    # -- match / insert ------------------------------------------------------------------------
    def match(self, key: tuple[int, ...], now: int, validate: Validate | None = None) -> tuple[list[TreeNode], int]:
        """Walk `key` from the root; return the matched nodes and the matched length in tokens.
        A node partially matched is split so the match ends on a node boundary; `validate`
        (components, tier filters) stops the walk before the first node it rejects."""
        node = self.root
        path: list[TreeNode] = []
        i, n = 0, len(key)
        ck = self._ck
        while i < n:
            child = node.children.get(ck(key, i))
            if child is None or (validate is not None and not validate(child)):
                break
            plen = self._common(child.key, key, i)
            if plen < len(child.key):
                child = self.split(child, plen)
            child.last_access = now
            path.append(child)
            i += plen
            node = child
        return path, i

    def insert_path(self, key: tuple[int, ...], now: int) -> tuple[list[tuple[TreeNode, int]], TreeNode | None]:
        """Make `key` a path of the tree. Returns every node on it with its token offset in `key`,
        and the newly created leaf (None when the key was already fully present)."""
        node = self.root
        path: list[tuple[TreeNode, int]] = []
        i, n = 0, len(key)
        ck = self._ck
        while i < n:
            child = node.children.get(ck(key, i))
            if child is None:
                leaf = TreeNode(next(self._ids), node, key[i:])
                leaf.last_access = now
                node.children[ck(key, i)] = leaf
                path.append((leaf, i))
                return path, leaf
            plen = self._common(child.key, key, i)
            if plen < len(child.key):
                child = self.split(child, plen)
            child.last_access = now
            path.append((child, i))
            i += plen
            node = child
        return path, None

    def split(self, child: TreeNode, at: int) -> TreeNode:
        """Split `child` after `at` tokens (a page multiple); returns the new parent (the prefix)."""
        if at <= 0 or at >= len(child.key) or at % self.page_size:
            raise ValueError(f"bad split point {at} for a node of {len(child.key)} tokens")
        pg = at // self.page_size
        parent = child.parent
        assert parent is not None
        new = TreeNode(next(self._ids), parent, child.key[:at])
        ck = self._ck
        parent.children[ck(child.key, 0)] = new
        child.key = child.key[at:]
        new.children[ck(child.key, 0)] = child
        child.parent = new
        # page-indexed state splits with the node
        if child.value is not None:
            new.value, child.value = child.value[:pg], child.value[pg:]
        if child.host_value is not None:
            new.host_value, child.host_value = child.host_value[:pg], child.host_value[pg:]
        if child.digests is not None:
            cut = pg * self.dlen
            new.digests, child.digests = child.digests[:cut], child.digests[cut:]
        # everything else is shared by both halves
        new.device_ready = child.device_ready
        new.host_ready = child.host_ready
        new.stored = child.stored
        new.lock_ref = child.lock_ref  # every lock on child passes through its new parent
        new.host_ref = child.host_ref
        new.last_access = child.last_access
        new.hit_count = child.hit_count
        if self.split_hook is not None:
            self.split_hook(new, child)
        return new

    # -- removal -------------------------------------------------------------------------------
    def remove_leaf(self, node: TreeNode) -> None:
        if node.children or node is self.root or node.parent is None:
            raise ValueError(f"{node!r} is not a removable leaf")
        parent = node.parent
        del parent.children[self._ck(node.key, 0)]
        node.parent = None

    def prune(self, node: TreeNode) -> list[TreeNode]:
        """Remove `node` and then its ancestors while each is a hollow, unlocked leaf."""
        removed = []
        while (node is not self.root and node.parent is not None and not node.children
               and node.hollow and not node.flights and node.lock_ref == 0):
            parent = node.parent
            self.remove_leaf(node)
            removed.append(node)
            node = parent
        return removed

    def clear(self) -> None:
        self.root.children.clear()

    # -- locks ---------------------------------------------------------------------------------
    def inc_lock(self, node: TreeNode) -> None:
        while node is not self.root:
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"lock underflow at {node!r}")
            node.lock_ref -= 1
            node = node.parent  # type: ignore[assignment]

    # -- traversal / hashing -------------------------------------------------------------------
    def nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def full_key(self, node: TreeNode) -> tuple[int, ...]:
        parts = []
        while node is not self.root and node is not None:
            parts.append(node.key)
            node = node.parent  # type: ignore[assignment]
        return tuple(t for part in reversed(parts) for t in part)

    def ensure_digests(self, node: TreeNode) -> bytes:
        """`node`'s page digests, concatenated (computing the chain down from the nearest hashed
        ancestor on first use: one call per node)."""
        d = node.digests
        if d is not None:
            return d
        todo = []
        n = node
        while n is not self.root and n.digests is None:
            todo.append(n)
            n = n.parent  # type: ignore[assignment]
        dl = self.dlen
        prior = n.digests[-dl:] if n is not self.root and n.digests else None
        chain, p = self.chain_blob, self.page_size
        for m in reversed(todo):
            m.digests = d = chain(m.key, p, prior)
            prior = d[-dl:]
        return d  # type: ignore[return-value]

    def ensure_hashes(self, node: TreeNode) -> list[int]:
        """Event ids of `node`'s pages (made from its digests on each call)."""
        return ids_of(self.ensure_digests(node), self.dlen)

    def digest_list(self, node: TreeNode) -> list[bytes]:
        """`node`'s page digests, one bytes per page (L3 keys)."""
        d, dl = self.ensure_digests(node), self.dlen
        return [d[i:i + dl] for i in range(0, len(d), dl)]

    def last_digest(self, node: TreeNode) -> bytes:
        return self.ensure_digests(node)[-self.dlen:]

    def parent_id(self, node: TreeNode) -> int | None:
        p = node.parent
        if p is None or p is self.root:
            return None
        d = self.ensure_digests(p)
        return int.from_bytes(d[len(d) - self.dlen:len(d) - self.dlen + 8], "big", signed=True)

    # -- eviction ------------------------------------------------------------------------------
    def evict_lru(self, need: int, candidate: Validate, evict: Callable[[TreeNode], int]) -> int:
        """Evict least-recently-used candidates until `need` pages are freed or none is left.
        `evict(node)` frees what it can and returns the page count; a parent that becomes a
        candidate is considered in the same pass."""
        heap = [(n.last_access, n.nid, n) for n in self.nodes() if candidate(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < need and heap:
            _, _, node = heapq.heappop(heap)
            if node.parent is None or not candidate(node):
                continue
            parent = node.parent
            freed += evict(node)
            if parent is not self.root and parent.parent is not None and candidate(parent):
                heapq.heappush(heap, (parent.last_access, parent.nid, parent))
        return freed
