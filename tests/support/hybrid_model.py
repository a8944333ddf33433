"""Brute-force model of a hybrid (multi-group) KV event stream: the rule the index must implement.

Per worker it keeps, per group, the tiers holding each block (set semantics, like the index), and
learns each block's content position from stores (`(parent hash, block tokens) -> hash`). For a
query it computes the usable prefix length (docs/hybrid.md "The rule"): the largest L such that
every full-attention group holds blocks [0, L), every sliding-window group (window W) holds the
last cdiv(W - 1, block_size) blocks before L, and every Mamba group holds a state at block L-1
(L = 0 always usable) — on the device alone, or allowing any tier per block.

Events without `group_idx` are group 0, full attention (SGLang's shape). A remove applies to its
own group only; a group never seen in a store is counted and ignored. Deliberately slow and plain.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from schemas.media import Medium, parse_medium

FULL_KINDS = ("full_attention", "mla_attention")


def _norm(h: int | bytes) -> int | bytes:
    return h & (2**64 - 1) if isinstance(h, int) else bytes(h)


class WorkerModel:
    def __init__(self) -> None:
        self.groups: dict[int, tuple[str, int | None]] = {}         # group -> (kind, window)
        self.tiers: dict[tuple[int, int | bytes], set[Medium]] = {}  # (group, hash) -> tiers
        self.child: dict[tuple[int | bytes | None, tuple[int, ...]], int | bytes] = {}
        self.ignored_removes = 0

    def clear(self) -> None:
        self.tiers.clear()  # content positions and group kinds stay learnt

    def apply(self, ev: object) -> None:
        if isinstance(ev, AllBlocksCleared):
            self.clear()
            return
        medium = parse_medium(ev.medium)  # type: ignore[attr-defined]
        assert medium is not None
        g = ev.group_idx if ev.group_idx is not None else 0  # type: ignore[attr-defined]
        if isinstance(ev, BlockStored):
            kind = ev.kv_cache_spec_kind or "full_attention"
            self.groups.setdefault(g, (kind, ev.kv_cache_spec_sliding_window))
            bs = ev.block_size
            parent = None if ev.parent_block_hash is None else _norm(ev.parent_block_hash)
            for i, h in enumerate(ev.block_hashes):
                h = _norm(h)
                if bs and len(ev.token_ids) >= (i + 1) * bs:
                    self.child[(parent, tuple(ev.token_ids[i * bs:(i + 1) * bs]))] = h
                self.tiers.setdefault((g, h), set()).add(medium)
                parent = h
        elif isinstance(ev, BlockRemoved):
            if g not in self.groups:
                self.ignored_removes += 1
                return
            for h in ev.block_hashes:
                s = self.tiers.get((g, _norm(h)))
                if s is not None:
                    s.discard(medium)

    def hashes(self, tokens: Sequence[int], block_size: int) -> list[int | bytes]:
        out: list[int | bytes] = []
        parent: int | bytes | None = None
        for i in range(len(tokens) // block_size):
            h = self.child.get((parent, tuple(tokens[i * block_size:(i + 1) * block_size])))
            if h is None:
                break
            out.append(h)
            parent = h
        return out

    def usable(self, tokens: Sequence[int], block_size: int, device_only: bool) -> int:
        """Usable prefix length in blocks (see the module docstring)."""
        hs = self.hashes(tokens, block_size)

        def has(g: int, i: int) -> bool:
            t = self.tiers.get((g, hs[i]), set())
            return Medium.GPU in t if device_only else bool(t)

        groups = self.groups or {0: ("full_attention", None)}
        best = 0
        for L in range(1, len(hs) + 1):
            ok = True
            for g, (kind, window) in groups.items():
                if kind in FULL_KINDS:
                    ok = all(has(g, i) for i in range(L))
                elif kind == "sliding_window":
                    w = max(0, -(-((window or 1) - 1) // block_size))
                    ok = all(has(g, i) for i in range(max(0, L - w), L))
                elif kind == "mamba":
                    ok = has(g, L - 1)
                if not ok:
                    break
            if ok:
                best = L
        return best

    def kv_blocks(self, tokens: Sequence[int], block_size: int) -> int:
        """Full-attention-only match over any tier (what other indexers report)."""
        hs = self.hashes(tokens, block_size)
        full = [g for g, (k, _) in (self.groups or {0: ("full_attention", None)}).items() if k in FULL_KINDS]
        n = 0
        for h in hs:
            if not all(self.tiers.get((g, h)) for g in full):
                break
            n += 1
        return n


class HybridModel:
    """Workers by id, each a `WorkerModel`."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.workers: dict[str, WorkerModel] = {}

    def apply(self, worker: str, events: Iterable[object]) -> None:
        w = self.workers.setdefault(worker, WorkerModel())
        for ev in events:
            w.apply(ev)

    def usable(self, worker: str, tokens: Sequence[int]) -> tuple[int, int]:
        """(device-only, any-tier) usable prefix in blocks."""
        w = self.workers.get(worker)
        if w is None:
            return 0, 0
        return w.usable(tokens, self.block_size, True), w.usable(tokens, self.block_size, False)
