"""Prefix matching: the longest usable cached prefix per tier (full attention), and the hybrid
rule where every component must validate the match end (docs/hybrid.md "Match semantics")."""
from __future__ import annotations

from collections.abc import Sequence

from producer.cache.state import CacheState
from producer.components.base import DEVICE, HOST, STORAGE
from producer.radix_tree import TreeNode


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
        self.branch_len = 0                        # hybrid: branching point (0 = off), docs/hybrid.md

    def __repr__(self) -> str:
        return (f"MatchResult(device={self.device_len}, host={self.host_len}, storage={self.storage_len}, "
                f"best={self.best_len}, loading={self.loading})")


class Matching(CacheState):
    """`match_prefix` and the path queries built on it."""

    @staticmethod
    def _usable(node: TreeNode) -> bool:
        return not node.hollow  # a node no tier holds only links its children: a match stops there

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
        # Branching (SGLang's mamba_branching_seqlen / swa_branching_seqlen): the KV runs past the
        # last usable state or window, so the engine may keep one there while it recomputes. Off
        # when the match relies on host-backed state.
        if kv_dev > dev and best == dev and self.components:
            r.branch_len = kv_dev * p
        return r

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
