"""Brute-force reference model of the index, for tests (ours and other engineers').

Same public surface as `indexer.index.KVIndex` for what it models (ensure_model, models, apply,
apply_payload, register_worker, clear_worker, remove_worker, workers, score, worker_stats: the part of
`indexer.protocol.Index` that has observable state; tests/test_index_conformance.py runs the same
suite on it and on both KVIndex cores), same semantics, no cleverness: a block's identity is the full
tuple of (namespace, every block's tokens and extra keys from the root), kept per worker as
`ext hash -> identity` plus `identity -> set of tiers`. It does not hash, does not hold orphans
(a store whose parent the worker does not hold is dropped at once) and has no trust mode; tests feed it
histories in their true order.

Groups (docs/hybrid.md, "The indexer"): each worker learns its own layout; stores naming a
full-attention / sliding-window / Mamba `group_idx` other than its main tree's keep per-group tiers
`(group, identity) -> tiers`; removes apply to their group only; a store contradicting the layout
resets the worker; a worker with such groups scores usable prefixes, checked per depth L by brute
force, and `kv_blocks`.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from indexer.core.groups import FULL, MAMBA, SWA, classify
from indexer.core.types import MEDIUM_NAMES, TIER_NAMES, ScoreResult, TierWeights, WorkerScore
from schemas.codec import DecodeError, decode_batch
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, is_full_attention
from schemas.media import parse_medium
from schemas.rules import window_blocks


def _extra_id(x: Any) -> bytes | None:
    return None if x is None else msgspec.msgpack.encode(x)


class _RefWorker:
    __slots__ = ("ext", "tiers", "gext", "gtiers", "has_groups", "primary", "groups")

    def __init__(self) -> None:
        self.ext: dict[Any, tuple] = {}
        self.tiers: dict[tuple, set[int]] = {}
        self.gext: dict[tuple[int, Any], tuple] = {}  # (group, hash) -> identity
        self.gtiers: dict[tuple[int, tuple], set[int]] = {}  # (group, identity) -> tiers
        # its layout (docs/hybrid.md: learned per worker and dp rank)
        self.has_groups = False
        self.primary: int | None = None
        self.groups: dict[int, tuple[int, int | None]] = {}  # non-primary group -> (kind, window)

    def clear(self) -> None:
        self.ext.clear()
        self.tiers.clear()
        self.gext.clear()
        self.gtiers.clear()

    def reset(self) -> None:
        """Its layout changed: every block and the layout go."""
        self.clear()
        self.has_groups = False
        self.primary = None
        self.groups = {}


class _RefModel:
    __slots__ = ("block_size", "workers")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.workers: dict[tuple[str, int], _RefWorker] = {}


class ReferenceIndex:
    def __init__(self, weights: TierWeights | None = None) -> None:
        self.weights = weights or TierWeights()
        self.models: dict[str, _RefModel] = {}

    def ensure_model(self, model: str, block_size: int) -> None:
        self.models.setdefault(model, _RefModel(block_size))

    def model_sizes(self) -> dict[str, int]:
        return {name: m.block_size for name, m in self.models.items()}

    def workers(self, model: str) -> list[tuple[str, int]]:
        return list(self.models[model].workers)

    def apply_payload(self, model: str, worker_id: str, dp_rank: int, payload: bytes) -> None:
        batch = decode_batch(payload)
        if isinstance(batch, DecodeError):
            batch = self._event_by_event(payload)  # one bad event never loses its neighbours
        if batch is not None:
            self.apply(model, worker_id, dp_rank, batch)

    @staticmethod
    def _event_by_event(payload: bytes) -> KVEventBatch | None:
        try:
            ts, events, *rank = msgspec.msgpack.decode(payload)
        except (msgspec.DecodeError, ValueError, TypeError, RecursionError):
            return None
        if not isinstance(events, list) or type(ts) not in (int, float) or len(rank) > 1 or (rank and rank[0] is not None and type(rank[0]) is not int):
            return None
        out = []
        for ev in events:
            one = decode_batch(msgspec.msgpack.encode([ts, [ev]]))
            if not isinstance(one, DecodeError):
                out.extend(one.events)
        return KVEventBatch(float(ts), out)

    def register_worker(self, model: str, worker_id: str, dp_rank: int = 0) -> None:
        self.models[model].workers.setdefault((worker_id, dp_rank), _RefWorker())

    def apply(self, model: str, worker_id: str, dp_rank: int, batch: KVEventBatch) -> None:
        m = self.models[model]
        w = m.workers.setdefault((worker_id, dp_rank), _RefWorker())
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._store(m, w, ev)
            elif isinstance(ev, BlockRemoved):
                gi = ev.group_idx
                if (gi or w.has_groups) and not (gi is None or gi == w.primary):
                    if gi in w.groups:
                        self._group_remove(w, gi, ev)
                    continue
                medium = parse_medium(ev.medium)
                if medium is None:
                    continue
                for h in ev.block_hashes:
                    ident = w.ext.get(h)
                    if ident is None:
                        continue
                    ts = w.tiers.get(ident, set())
                    ts.discard(int(medium))
                    if not ts:
                        w.tiers.pop(ident, None)
                        del w.ext[h]
            elif isinstance(ev, AllBlocksCleared):
                w.clear()

    def _group_remove(self, w: _RefWorker, g: int, ev: BlockRemoved) -> None:
        medium = parse_medium(ev.medium)
        if medium is None:
            return
        for h in ev.block_hashes:
            ident = w.gext.get((g, h))
            if ident is None:
                continue
            ts = w.gtiers.get((g, ident), set())
            ts.discard(int(medium))
            if not ts:
                w.gtiers.pop((g, ident), None)
                del w.gext[(g, h)]

    def _route(self, w: _RefWorker, ev: BlockStored) -> int | None:
        """The group a store goes to: None for the main tree (or the main path's skip)."""
        gi = ev.group_idx
        if gi is None or not (gi or w.has_groups or not is_full_attention(ev.kv_cache_spec_kind)):
            return None
        kind = classify(ev.kv_cache_spec_kind)
        if kind is None or gi < 0:
            return None
        spec = (kind, ev.kv_cache_spec_sliding_window if kind == SWA else None)
        if w.has_groups and ((gi == w.primary and kind != FULL) or w.groups.get(gi, spec) != spec):
            w.reset()
        if not w.has_groups:
            if gi == 0 and kind == FULL:
                return None
            w.has_groups = True
            w.primary = 0 if w.tiers else None
        if w.primary is None and kind == FULL and gi not in w.groups:
            w.primary = gi
        if gi == w.primary:
            return None
        w.groups.setdefault(gi, spec)
        return gi

    def _group_store(self, m: _RefModel, w: _RefWorker, g: int, ev: BlockStored, tier: int) -> None:
        hashes = ev.block_hashes

        def known(h: Any) -> tuple | None:
            i = w.gext.get((g, h))
            return i if i is not None else w.ext.get(h)

        if ev.block_size == 0 or not ev.token_ids:
            if all(known(h) is not None for h in hashes):
                for h in hashes:
                    ident = known(h)
                    w.gext[(g, h)] = ident
                    w.gtiers.setdefault((g, ident), set()).add(tier)
            return
        bs = m.block_size
        if ev.block_size != bs:
            return
        nfull = min(len(hashes), len(ev.token_ids) // bs)
        extras = self._extras(ev)
        prefix = ((ev.lora_name, ev.cache_salt),) if ev.parent_block_hash is None else known(ev.parent_block_hash)
        for j in range(nfull):
            ident = known(hashes[j])
            if ident is None:
                if prefix is None:
                    return  # orphan: dropped
                ident = prefix + ((tuple(int(t) for t in ev.token_ids[j * bs : (j + 1) * bs]), extras[j]),)
            w.gext[(g, hashes[j])] = ident
            w.gtiers.setdefault((g, ident), set()).add(tier)
            prefix = ident

    @staticmethod
    def _extras(ev: BlockStored) -> list:
        xk, n = ev.extra_keys, len(ev.block_hashes)
        if xk and len(xk) == n:
            return [_extra_id(x) for x in xk]
        return [_extra_id(xk) if xk else None] * n

    def _store(self, m: _RefModel, w: _RefWorker, ev: BlockStored) -> None:
        medium = parse_medium(ev.medium)
        if medium is None:
            return
        g = self._route(w, ev)
        if g is not None:
            self._group_store(m, w, g, ev, int(medium))
            return
        if not is_full_attention(ev.kv_cache_spec_kind):
            return
        tier = int(medium)
        hashes = ev.block_hashes
        if ev.block_size == 0 or not ev.token_ids:
            if all(h in w.ext for h in hashes):
                for h in hashes:
                    w.tiers.setdefault(w.ext[h], set()).add(tier)
            return
        bs = m.block_size
        if ev.block_size != bs:
            return
        nfull = min(len(hashes), len(ev.token_ids) // bs)
        extras = self._extras(ev)
        if ev.parent_block_hash is None:
            prefix: tuple = ((ev.lora_name, ev.cache_salt),)
        else:
            p = w.ext.get(ev.parent_block_hash)
            if p is None and (nfull == 0 or hashes[0] not in w.ext):
                return  # orphan: dropped
            prefix = p if p is not None else ()  # else the first block is mapped and starts the chain
        for j in range(nfull):
            h = hashes[j]
            ident = w.ext.get(h)
            if ident is None:
                block = (tuple(int(t) for t in ev.token_ids[j * bs : (j + 1) * bs]), extras[j])
                ident = prefix + (block,)
                w.ext[h] = ident
            w.tiers.setdefault(ident, set()).add(tier)
            prefix = ident

    def clear_worker(self, model: str, worker_id: str, dp_rank: int | None = None) -> None:
        for (wid, r), w in self.models[model].workers.items():
            if wid == worker_id and (dp_rank is None or r == dp_rank):
                w.clear()

    def remove_worker(self, model: str, worker_id: str, dp_rank: int | None = None) -> None:
        ws = self.models[model].workers
        for k in [k for k in ws if k[0] == worker_id and (dp_rank is None or k[1] == dp_rank)]:
            del ws[k]

    def worker_stats(self, model: str) -> dict[tuple[str, int], dict[str, int]]:
        out = {}
        for k, w in self.models[model].workers.items():
            counts = [0, 0, 0, 0]
            for ts in w.tiers.values():
                for t in ts:
                    counts[t] += 1
            out[k] = dict(zip(TIER_NAMES, counts))
        return out

    def score(
        self,
        model: str,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
        workers: Iterable[tuple[str, int]] | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> ScoreResult:
        m = self.models[model]
        bs = m.block_size
        tokens = [int(t) for t in token_ids]
        nq = len(tokens) // bs
        idents = []
        prefix: tuple = ((lora_name, cache_salt),)
        for i in range(nq):
            x = extra_keys[i] if extra_keys and i < len(extra_keys) else None
            prefix = prefix + ((tuple(tokens[i * bs : (i + 1) * bs]), _extra_id(x)),)
            idents.append(prefix)
        keys = list(m.workers) if workers is None else [k for k in workers if k in m.workers]
        pool = set()
        for w in m.workers.values():
            for ident, ts in w.tiers.items():
                if 3 in ts:
                    pool.add(ident)
        wt = self.weights.as_tuple()
        out = []
        out = [self._score_groups(m, k, idents, pool, wt) for k in keys if m.workers[k].groups]
        for k in keys:
            if m.workers[k].groups:
                continue
            w = m.workers[k]
            device = 0
            while device < nq and 0 in w.tiers.get(idents[device], ()):
                device += 1
            split = [0, 0, 0, 0]
            cached = 0
            for ident in idents:
                ts = w.tiers.get(ident, set())
                own = [t for t in (0, 1, 2) if t in ts]
                if own:
                    split[own[0]] += 1
                elif ident in pool:
                    split[3] += 1
                else:
                    break
                cached += 1
            out.append(
                WorkerScore(
                    worker_id=k[0], dp_rank=k[1], device_blocks=device, cached_blocks=cached,
                    tiers=dict(zip(TIER_NAMES, split)),
                    score=float(bs * (split[0] * wt[0] + split[1] * wt[1] + split[2] * wt[2] + split[3] * wt[3])),
                )
            )
        out.sort(key=lambda s: (-s.score, -s.cached_blocks, s.worker_id, s.dp_rank))
        return ScoreResult(query_blocks=nq, block_size=bs, workers=out)

    def _score_groups(self, m: _RefModel, k: tuple[str, int], idents: list, pool: set, wt: tuple) -> WorkerScore:
        """One worker's row for a model with groups: every depth L checked against the rule."""
        w = m.workers[k]
        bs = m.block_size
        gpool: dict[int, set] = {g: set() for g in w.groups}  # a group's pool: claims of every worker with it
        for ww in m.workers.values():
            for (g, ident), ts in ww.gtiers.items():
                if 3 in ts and g in w.groups and ww.groups.get(g) == w.groups[g]:
                    gpool[g].add(ident)

        def tier(g: int | None, ident: tuple) -> int:  # cheapest tier holding it, 4 if none
            ts = w.tiers.get(ident, set()) if g is None else w.gtiers.get((g, ident), set())
            own = [t for t in (0, 1, 2) if t in ts]
            if own:
                return own[0]
            return 3 if ident in (pool if g is None else gpool[g]) else 4

        full = [None] + [g for g, (kind, _) in w.groups.items() if kind == FULL]

        def needs(L: int) -> list[tuple[int | None, int]]:  # (group, block) pairs a prefix of L needs
            out = [(g, i) for g in full for i in range(L)]
            for g, (kind, window) in w.groups.items():
                if kind == SWA:
                    span = L if window is None else min(L, window_blocks(window, bs))
                    out += [(g, i) for i in range(L - span, L)]
                elif kind == MAMBA and L:
                    out.append((g, L - 1))
            return out

        def usable(limit: int) -> int:
            return max(L for L in range(len(idents) + 1) if all(tier(g, idents[i]) <= limit for g, i in needs(L)))

        kv = 0
        while kv < len(idents) and tier(None, idents[kv]) < 4:  # the main tree alone
            kv += 1
        cached = usable(3)
        split = [0, 0, 0, 0]
        worst = [0] * cached
        for g, i in needs(cached):
            worst[i] = max(worst[i], tier(g, idents[i]))
        for t in worst:
            split[t] += 1
        return WorkerScore(
            worker_id=k[0], dp_rank=k[1], device_blocks=usable(0), cached_blocks=cached,
            tiers=dict(zip(TIER_NAMES, split)),
            score=float(bs * (split[0] * wt[0] + split[1] * wt[1] + split[2] * wt[2] + split[3] * wt[3])),
            kv_blocks=kv,
        )


__all__ = ["ReferenceIndex", "MEDIUM_NAMES"]
