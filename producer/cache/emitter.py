"""The one place the cache's events are recorded. Every `Stored` passes through `StoreEmitter.stored`
(or `.comp(..., stored=True)`) and only for bytes that are acknowledged on that tier: computed on
the device (insert), landed by a copy (device ↔ host), confirmed by the L3 backend, or read back
from it (design §3 — SGLang announces load-back at issue; we do not). The check is the rule's
choke point: a store for a tier the node does not hold acknowledged raises instead of lying.
"""
from __future__ import annotations

from producer.components.base import DEVICE, HOST, STORAGE, Component
from producer.events import EventRecorder
from producer.page_hash import DIGEST_LEN, fused_digest
from producer.radix_tree import RadixTree, TreeNode
from schemas.media import Medium

_TIER = {Medium.GPU: DEVICE, Medium.CPU_PINNED: HOST, Medium.DISK: STORAGE, Medium.EXTERNAL: STORAGE}


def kv_acked(node: TreeNode, medium: Medium) -> bool:
    """Whether `node`'s KV is resident and acknowledged on `medium`'s tier."""
    if medium is Medium.GPU:
        return node.value is not None and node.device_ready
    if medium is Medium.CPU_PINNED:
        return node.host_value is not None and node.host_ready
    return node.stored


class UnacknowledgedStore(AssertionError):
    """A `Stored` was about to be emitted for bytes not acknowledged on that tier (a cache bug)."""


class StoreEmitter:
    """Records the cache's KV and component events into its `EventRecorder`."""

    __slots__ = ("rec", "tree", "page_size", "grp", "kind", "fused", "chain_specs")

    def __init__(self, rec: EventRecorder, tree: RadixTree, page_size: int, page_hash: str,
                 component_events: bool, full_kind: str) -> None:
        self.rec = rec
        self.tree = tree
        self.page_size = page_size
        self.grp = component_events
        self.kind = full_kind
        # Whether a new node's hashing and store can be one native call (`Batch.stored_chain`).
        fused, digest_fn = fused_digest(page_hash)
        self.fused = fused
        # `Batch.stored_chain`'s per-tier arguments (the recorder is fixed at construction).
        self.chain_specs: dict[Medium, tuple] = {
            m: (digest_fn, DIGEST_LEN[page_hash], page_size, page_size, rec.names[m],
                0 if component_events else None, full_kind if component_events else None, None) for m in Medium}

    def stored(self, node: TreeNode, medium: Medium) -> None:
        """`BlockStored` for the node's pages on `medium`, whose bytes must be acknowledged there."""
        rec = self.rec
        if not rec.enabled:
            return
        if not kv_acked(node, medium):
            raise UnacknowledgedStore(f"store of {node!r} on {medium.name} before its ack")
        tree = self.tree
        b = rec.batch
        if b is not None and node.digests is None and self.fused:
            # A new node: its pages are hashed and its store recorded in one native call (the
            # token ids are read once, docs/producer-events.md). What it declines is hashed
            # and recorded below, which raises what hashing raises.
            p = node.parent
            try:
                node.digests = b.stored_chain(
                    node.key, None if p is tree.root or p is None else (p.digests or tree.ensure_digests(p)),
                    self.chain_specs[medium])
                return
            except (TypeError, OverflowError, ValueError):
                pass
        # The node's digests go to the recorder as they are: ids are read from them only when
        # the batch is built (docs/producer-events.md).
        if self.grp:
            rec.stored_digests(tree.ensure_digests(node), tree.dlen, tree.parent_id(node), node.key,
                               self.page_size, medium, group_idx=0, kind=self.kind)
        else:
            rec.stored_digests(tree.ensure_digests(node), tree.dlen, tree.parent_id(node), node.key,
                               self.page_size, medium)

    def removed(self, node: TreeNode, medium: Medium) -> None:
        rec = self.rec
        if rec.enabled:
            tree = self.tree
            d = node.digests or tree.ensure_digests(node)
            b = rec.batch
            if b is not None:  # straight into the native batch (the recorder's own fast path)
                try:
                    b.removed_digests(d, tree.dlen, rec.names[medium], 0 if self.grp else None)
                    return
                except (TypeError, OverflowError):
                    pass
            rec.removed_digests(d, tree.dlen, medium, group_idx=0 if self.grp else None)

    def comp_blocks(self, node: TreeNode, c: Component) -> tuple[list[int], int | None, tuple[int, ...]]:
        """(block ids, parent id, tokens) a component's state at `node` names: every page for
        per-page components; the last page only for a Mamba state (the block at whose end it sits)."""
        ids = self.tree.ensure_hashes(node)
        if c.per_page:
            return ids, self.tree.parent_id(node), node.key
        parent = ids[-2] if len(ids) > 1 else self.tree.parent_id(node)
        return ids[-1:], parent, node.key[-self.page_size:]

    def comp(self, node: TreeNode, c: Component, medium: Medium, stored: bool) -> None:
        """A component's group event (only with `component_events`: by default, SGLang-compatible,
        component-only changes are silent)."""
        rec = self.rec
        if not (self.grp and rec.enabled):
            return
        if stored:
            st = node.components.get(c.name) if node.components else None
            if st is None or not st.on(_TIER[medium]):
                raise UnacknowledgedStore(f"{c.name} store of {node!r} on {medium.name} before its ack")
        ids, parent, tokens = self.comp_blocks(node, c)
        if stored:
            rec.stored(ids, parent, tokens, self.page_size, medium, group_idx=c.group_idx, kind=c.kind,
                       window=c.window)
        else:
            rec.removed(ids, medium, group_idx=c.group_idx)
