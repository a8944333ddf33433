"""An in-flight operation (a copy between tiers, an L3 backup or prefetch) and the nodes it concerns."""
from __future__ import annotations

from producer.components.base import Component
from producer.radix_tree import TreeNode


class Flight:
    """One in-flight operation and the nodes it concerns (splits add the new halves)."""

    __slots__ = ("kind", "nodes", "dst_pages", "lock_node", "cancelled", "deadline", "key", "start", "keys",
                 "pending", "failed", "kv", "parts", "comps", "npages", "bufs")

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
        self.bufs: list[memoryview] = []  # a prefetch's destination buffers (written by the storage thread)

    def attach(self, node: TreeNode) -> None:
        self.nodes.append(node)
        node.flights.append(self)

    def detach_all(self) -> None:
        for n in self.nodes:
            if self in n.flights:
                n.flights.remove(self)


def depth(node: TreeNode) -> int:
    """Edges from the root (acks are applied parents first: events chain from known blocks)."""
    d = 0
    while node.parent is not None:
        d += 1
        node = node.parent
    return d
