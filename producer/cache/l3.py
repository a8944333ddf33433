"""The storage tier (L3): backups of landed host copies, prefetches back into host memory, and the
backend's eviction notices. A node's L3 copy is claimed (`Stored(DISK|EXTERNAL)`) only when the
backend confirmed every key of it, and un-claimed as soon as one of its keys is gone."""
from __future__ import annotations

from collections.abc import Sequence

from producer.allocator import PoolExhausted
from producer.cache.flight import Flight, depth
from producer.cache.matching import MatchResult
from producer.cache.state import CacheState
from producer.components.base import HOST, Component
from producer.radix_tree import TreeNode
from producer.storage.base import BytesLike
from producer.storage.keys import page_key, split_key
from schemas.media import Medium


class L3(CacheState):
    """Backup to and prefetch from the storage backend, and forgetting what it evicted."""

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

    def _page_keys(self, digests: Sequence[bytes]) -> list[list[str]]:
        """L3 keys per pool for these pages: KV, each extra pool, each component (per page)."""
        out = [[page_key(d, self.config.storage_suffix) for d in digests]]
        out += [[page_key(d, x.suffix) for d in digests] for x in self.extras]
        out += [[page_key(d, c.suffix) for d in digests] for c in self.components]
        return out

    def _store_knows(self, keys: list[str]) -> list[bool] | None:
        """What the L3 backend itself knows it holds, when its contents are local (a node-local
        store keeps an index of its keys); None for a shared store other workers write to."""
        backend = self.storage.backend
        return None if backend.shared else backend.knows(keys)

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
        blocks = self._page_keys(digests)[:1 + len(self.extras)]  # the KV and what travels with it
        flags = self._store_knows([k for b in blocks for k in b])
        if flags is not None:
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
        # Zero copy: KV and extra pools land straight in the reserved host pages; component states
        # (several tensors a slot) in scratch buffers copied into their slots on arrival.
        bufs = [self.host.page_view(j) for j in hp]
        for x in self.extras:
            bufs += [x.page_view(j) for j in hp]
        for c in f.comps:
            bufs += [memoryview(bytearray(c.pool(HOST).slot_bytes)) for _ in hp]
        f.bufs = bufs
        f.key = key[:end]
        f.start = start
        f.keys = keys
        now = self.clock() if now is None else now
        f.deadline = (now + self.config.prefetch_timeout_base_s
                      + self.config.prefetch_timeout_per_1k_tokens_s * (end - start) / 1000.0)
        if not self.storage.submit_get_into(keys, bufs, f):
            self._release_prefetch(f)
            self.host.free(hp)
            self._count("prefetch_rejected")
            return False
        self._prefetches.append(f)
        self._count("prefetch_issued")
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
        # views of the host pages themselves (zero copy): they stay protected until the result
        values: list[BytesLike] = [host.page_view(p) for p in hv]  # type: ignore[union-attr]
        for x in self.extras:
            values += [x.page_view(p) for p in hv]
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

    def _finish_prefetch(self, f: Flight, sizes: list[int] | None) -> None:
        if f.cancelled:
            if f in self._draining:  # timed out or reset: its pages were held until the read ended
                self._draining.remove(f)
                self.host.free(f.dst_pages)  # type: ignore[union-attr]
            return
        self._release_prefetch(f)
        host = self.host
        assert host is not None
        npg = f.npages
        got_n = list(sizes or [])
        if len(got_n) != len(f.keys):
            got_n = [-1] * len(f.keys)
        nx = len(self.extras)
        want = [host.page_bytes] + [x.page_bytes() for x in self.extras]
        # a page is usable only when the KV and every extra pool came back whole
        k = 0
        for j in range(npg):
            row = [got_n[b * npg + j] for b in range(1 + nx)]
            if row != want:
                if any(n >= 0 for n in row):
                    self._count("prefetch_bad_value")
                break
            k += 1
        hp = f.dst_pages
        bufs = f.bufs
        vals: list[bytes | None] = [None] * len(f.keys)
        for i in range((1 + nx) * npg, len(f.keys)):  # component states: copied out of their scratch
            if got_n[i] >= 0:
                vals[i] = bytes(bufs[i][:got_n[i]])
        f.bufs = []

        def blk(b: int) -> list[bytes | None]:
            return vals[b * npg:(b + 1) * npg]
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
        aux: list[tuple[TreeNode, int]] = []  # KV already on the host: only components may be missing there
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
                # on the host already (put there meanwhile, or the prefix was not usable there for want
                # of a component state: the aux-only fetch, whose states land below)
                spare.extend(pg)
                if node.host_ready:
                    aux.append((node, a))
                continue
            node.host_value = pg
            node.host_ready = True
            got.append((node, a))
        if spare:
            host.free(spare)
        landed: list[tuple[TreeNode, Component]] = []
        targets = got + aux
        for node, _ in targets:  # a component's host slots may evict host nodes: never these
            node.host_ref += 1
        try:
            for node, a in targets:  # each component lands with its node's KV, whole or not at all
                kp = len(node.key) // p
                for c in f.comps:
                    old = self._state(node, c)
                    if old is not None and old.host is not None:
                        continue  # already there (aux-only nodes)
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
        finally:
            for node, _ in targets:
                node.host_ref -= 1
        nodes = [n for n, _ in got]
        for node in nodes:
            self.emit.stored(node, Medium.CPU_PINNED)
        for node, c in landed:
            self.emit.comp(node, c, Medium.CPU_PINNED, True)
        for node in nodes:
            if not node.stored:  # the bytes were just read from L3: they are there
                node.stored = True
                for key in self._l3_keys(node):
                    self._l3_index[key] = node
                self.emit.stored(node, self.l3_medium)  # type: ignore[arg-type]
        for node, c in landed:
            cst = self._state(node, c)
            if cst is not None and not cst.stored:
                cst.stored = True
                for key in self._comp_keys(node, c):
                    self._l3_index[key] = node
                self.emit.comp(node, c, self.l3_medium, True)  # type: ignore[arg-type]
        self._count("prefetch_pages", k)
        self._count("prefetch_landed_pages", sum(len(n.key) for n, _ in got) // p)  # KV the host lacked
        if landed:
            self._count("prefetch_component_states", len(landed))

    def _finish_backup(self, f: Flight, keys: list[str], ok: list[bool]) -> None:
        if f.cancelled:
            return
        okmap = dict(zip(keys, ok))
        nodes = sorted(f.nodes, key=depth)
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
                    self.emit.stored(n, self.l3_medium)  # type: ignore[arg-type]
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
                self.emit.comp(n, c, self.l3_medium, True)  # type: ignore[arg-type]

    def _unclaim_comp_l3(self, n: TreeNode, c: Component) -> bool:
        """Drop a component's L3 copy at `n` from the index of keys and announce its removal;
        False when it had none."""
        st = self._state(n, c)
        if st is None or not st.stored:
            return False
        st.stored = False
        for k in self._comp_keys(n, c):
            self._l3_index.pop(k, None)
        self.emit.comp(n, c, self.l3_medium, False)  # type: ignore[arg-type]
        return True

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
                if self._unclaim_comp_l3(n, c):
                    self._clean_state(n, c)
            if comp is not None:
                self._l3_index.pop(k, None)
                continue
            # One page (of any pool) gone breaks the node's L3 copy: un-claim all of it.
            for kk in self._l3_keys(n):
                self._l3_index.pop(kk, None)
            if n.stored:
                n.stored = False
                self.emit.removed(n, self.l3_medium)  # type: ignore[arg-type]
                self._count("l3_evicted_nodes")
            self._prune_if_empty(n)

    def _poll_storage(self, now: float) -> None:
        """Apply the backend's results and eviction notices, expire prefetches, retry deferred backups."""
        # Evictions first, results second, applied results-then-evictions: a key's set result
        # always precedes its eviction notice, so no eviction is applied before its store.
        evicted = self.storage.drain_evicted()
        for r in self.storage.poll():
            tag = r.tag
            if not isinstance(tag, Flight):
                continue
            if r.op == "set":
                self._finish_backup(tag, r.keys, r.ok)
            elif r.op == "get_into":
                self._finish_prefetch(tag, r.sizes)
        if evicted:
            self._forget_l3(evicted)
        for f in list(self._prefetches):
            if now > f.deadline:
                f.cancelled = True
                self._release_prefetch(f)
                self._draining.append(f)  # the store may still write into its pages: freed on its result
                self._count("prefetch_timeouts")
        for _ in range(len(self._backup_retry)):
            node = self._backup_retry.popleft()
            self._backup_to_storage(node)
