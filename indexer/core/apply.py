"""Applying event batches to one model namespace (design §4). Pure functions over ModelState.

Hot path shape: one pre-pass hashes the token ids of every store in the batch whose engine hashes
are not yet known, in a single vectorised call (`block_digests`); the ordered pass then only does a
scalar chain step (`s*P + b`) and dict/bit updates per new block. Known hashes (tier changes,
load-backs, placeholders, and in trust mode hashes already seen on another worker) skip hashing.

This module is the reference for the rules: the C accelerator applies the common case of a raw
payload by the same rules and hands anything else (orphans, odd events) back here
(`indexer.core.accel`, docs/index-core.md). The maps may be dicts or the accelerator's U64Maps:
only the mapping interface is used.
"""
from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np

from indexer.core.groups import route_remove, route_store
from indexer.core.state import ModelState, PendingOrphan, WorkerState, unset_tier
from indexer.core.types import (
    CLEARED_KEY, DROP_NON_FULL, DROP_PLACEHOLDER, MEDIUM_NAMES, REMOVE_OUTCOMES,
    STORE_OUTCOMES, ApplyStats, full_block_hashes,
)
from indexer.hashing import CHAIN_P, MASK64, block_digest_py, block_digests, extra_digest
from schemas.codec import DecodeError, decode_batch
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, is_full_attention
from schemas.media import parse_medium

KNOWN_EXT_LIMIT = 4_000_000  # trust-mode cache of engine hash -> key; cleared when it grows past this


class UndecodableEvent:
    """Stands in a salvaged batch for one event the decoder refused (`decode_or_drop`): it keeps the
    batch's event count and order, and `apply_events` counts it as the drop `reason`."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Shell(msgspec.Struct, array_like=True):
    """A batch with its events left undecoded: what `decode_or_drop` salvages event by event."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_shell_decoder = msgspec.msgpack.Decoder(_Shell)
_encode = msgspec.msgpack.encode
# Whole-payload verdicts that may come from one event only: the others are still worth applying.
_PER_EVENT_REASONS = frozenset(("invalid", "unknown_tag", "bad_hash"))


_HASH_TYPES = frozenset((int, bytes))


def _hash_ok(h: object) -> bool:
    return type(h) is int or type(h) is bytes

def _extras_for(ev: BlockStored, n: int) -> list[int] | None:
    """Per-block extra-key digests (vLLM: one entry per block, None where the block has none)."""
    xk = ev.extra_keys
    if not xk:
        return None
    if len(xk) == n:
        return [extra_digest(x) for x in xk]
    d = extra_digest(xk)  # not per block: the whole list qualifies every block of the event
    return [d] * n


def _precompute(m: ModelState, w: WorkerState, events: list) -> dict[int, list[int]]:
    """Digests for stores that (as far as the pre-batch state tells) contain unknown hashes."""
    bs = m.block_size
    ext = w.ext
    known = m.known_ext if m.trust else None
    toks: list[int] = []
    extras: list[int] = []
    any_extra = False
    spans: list[tuple[int, int, int]] = []
    for i, ev in enumerate(events):
        if type(ev) is not BlockStored or ev.block_size != bs or not ev.token_ids:
            continue
        hashes = ev.block_hashes
        nfull = min(len(hashes), len(ev.token_ids) // bs)
        if nfull == 0:
            continue
        for h in hashes[:nfull]:
            if h not in ext and (known is None or h not in known):
                break
        else:
            continue
        start = len(toks) // bs
        toks.extend(ev.token_ids[: nfull * bs])
        ex = _extras_for(ev, len(hashes))
        if ex is None:
            extras.extend([0] * nfull)
        else:
            extras.extend(ex[:nfull])
            any_extra = True
        spans.append((i, start, nfull))
    if not spans:
        return {}
    try:
        mat = np.asarray(toks, dtype=np.int64).reshape(-1, bs)
    except (OverflowError, ValueError, TypeError):
        return {}  # bad token values: the ordered pass hashes per event and counts the bad one
    d = block_digests(mat, extras if any_extra else None).tolist()
    return {i: d[s : s + n] for i, s, n in spans}


def _digests_scalar(ev: BlockStored, bs: int, nfull: int) -> list[int] | None:
    ex = _extras_for(ev, len(ev.block_hashes))
    toks = ev.token_ids
    try:
        return [
            block_digest_py([int(t) for t in toks[j * bs : (j + 1) * bs]], ex[j] if ex else 0)
            for j in range(nfull)
        ]
    except (TypeError, ValueError):
        return None


def _attach(
    m: ModelState, w: WorkerState, hashes: list, state: int, digests: list[int] | None,
    ev: BlockStored | None, tier: int, cancelled: set | None,
) -> tuple[int, int, int] | None:
    """Store a chain of blocks starting from `state`. Returns (new, duplicate, tier_added), or None when
    digests were needed and the event's tokens do not hash (bad values)."""
    nodes = m.nodes
    ext = w.ext
    known = m.known_ext if m.trust else None
    bit = 1 << (w.shift + tier)
    new = dup = added = 0
    for j, h in enumerate(hashes):
        key = ext.get(h)
        if key is None:
            if known is not None:
                key = known.get(h)
            if key is None:
                if digests is None:
                    digests = _digests_scalar(ev, m.block_size, len(hashes)) if ev is not None else None
                    if digests is None:
                        return None
                key = (state * CHAIN_P + digests[j]) & MASK64  # hashing.step_py, inlined (hot loop)
                if known is not None:
                    if len(known) >= KNOWN_EXT_LIMIT:
                        known.clear()
                    known[h] = key
            state = key
            if cancelled is not None and h in cancelled:
                continue  # stored and removed again while it waited for its parent
            ext[h] = key
            r = nodes.get(key, 0)
            nodes[key] = r | bit
            if r & bit:
                dup += 1
            else:
                new += 1
        else:
            state = key
            if cancelled is not None and h in cancelled:
                continue
            r = nodes.get(key, 0)
            if r & bit:
                dup += 1
            else:
                nodes[key] = r | bit
                added += 1
    return new, dup, added


def _store(m: ModelState, w: WorkerState, ev: BlockStored, digests: list[int] | None, stats: ApplyStats) -> None:
    hashes = ev.block_hashes
    n = len(hashes)
    if not _HASH_TYPES.issuperset(map(type, hashes)) or not (ev.parent_block_hash is None or _hash_ok(ev.parent_block_hash)):
        stats.drop("bad_event")  # a hand-built event (the decoder gives ints and bytes only): judged before any change
        return
    medium = parse_medium(ev.medium)
    if medium is None:
        stats.drop("unknown_medium", n)
        return
    mname = MEDIUM_NAMES[medium]
    gi = ev.group_idx  # another group than the main tree's goes to its own map (docs/hybrid.md)
    if gi is not None and (gi or w.layout is not None or not is_full_attention(ev.kv_cache_spec_kind)):
        if route_store(m, w, ev, stats):
            return
    if not is_full_attention(ev.kv_cache_spec_kind):
        stats.drop(DROP_NON_FULL, n)
        return
    tier = int(medium)
    bs = m.block_size
    ext = w.ext
    ntok = len(ev.token_ids) if ev.token_ids else 0
    if ev.block_size == 0 or not ntok:
        # Placeholder: only records a new tier on blocks this worker already maps.
        for h in hashes:
            if h not in ext:
                stats.drop(DROP_PLACEHOLDER, n)
                return
        res = _attach(m, w, hashes, 0, None, None, tier, None)
        assert res is not None
        _count_store(stats, mname, res)
        return
    hashes = full_block_hashes(ev, ntok, bs, stats)
    if not hashes:
        return  # nothing to store (an event with no full block), whatever its parent
    nfull = len(hashes)
    parent = ev.parent_block_hash
    if parent is None:
        state = m.seed(ev.lora_name, ev.cache_salt)
    else:
        state = ext.get(parent)
        if state is None and hashes[0] in ext:
            state = 0  # the first block is already mapped: its key, not the parent, starts the chain
        if state is None:
            if digests is None:
                digests = _digests_scalar(ev, bs, nfull)
                if digests is None:
                    stats.drop("bad_tokens", nfull)
                    return
            w.pending.append(PendingOrphan(list(hashes), parent, digests, tier, mname))
            stats.count("stored", mname, "orphan_held", nfull)
            return
    res = _attach(m, w, hashes, state, digests, ev, tier, None)
    if res is None:
        stats.drop("bad_tokens", nfull)
        return
    _count_store(stats, mname, res)


def _count_store(stats: ApplyStats, mname: str, res: tuple[int, int, int]) -> None:
    for outcome, n in zip(STORE_OUTCOMES, res):
        stats.count("stored", mname, outcome, n)


def _remove(m: ModelState, w: WorkerState, ev: BlockRemoved, stats: ApplyStats) -> None:
    if (ev.group_idx or w.layout is not None) and route_remove(m, w, ev, stats):
        return  # another group's remove: never the KV block with the same hash (docs/hybrid.md)
    hashes = ev.block_hashes
    if not _HASH_TYPES.issuperset(map(type, hashes)):
        stats.drop("bad_event")
        return
    medium = parse_medium(ev.medium)
    if medium is None:
        stats.drop("unknown_medium", len(hashes))
        return
    mname = MEDIUM_NAMES[medium]
    tier = int(medium)
    nodes = m.nodes
    ext = w.ext
    sh = w.shift
    bit = 1 << (sh + tier)
    removed = absent = cancelled = 0
    for h in hashes:
        hit = unset_tier(nodes, ext, h, bit, sh)
        if hit:
            removed += 1
        elif hit is None and w.pending and _cancel_pending(w, h, tier):
            cancelled += 1
        else:
            absent += 1
    for outcome, n in zip((*REMOVE_OUTCOMES, "pending_cancelled"), (removed, absent, cancelled)):
        stats.count("removed", mname, outcome, n)


def _cancel_pending(w: WorkerState, h: Any, tier: int) -> bool:
    for p in w.pending:
        if p.tier == tier and h in p.hashes:
            if p.cancelled is None:
                p.cancelled = set()
            if h in p.cancelled:
                return False
            p.cancelled.add(h)
            return True
    return False


def _resolve_orphans(m: ModelState, w: WorkerState, grace: int, stats: ApplyStats) -> None:
    progress = True
    while progress and w.pending:
        progress = False
        still = []
        for p in w.pending:
            state = w.ext.get(p.parent)
            if state is None:
                still.append(p)
                continue
            progress = True
            res = _attach(m, w, p.hashes, state, p.digests, None, p.tier, p.cancelled)
            assert res is not None
            stats.count("stored", p.medium, "orphan_attached", len(p.hashes))
            _count_store(stats, p.medium, res)
        w.pending = still
    if not w.pending:
        stats.orphans_pending = 0
        return
    keep = []
    for p in w.pending:
        p.age += 1
        if p.age > grace:
            n = len(p.hashes)
            stats.orphans_dropped += n
            stats.drop("orphan_expired", n)
            stats.resync_needed = True
        else:
            keep.append(p)
    w.pending = keep
    stats.orphans_pending = sum(len(p.hashes) for p in keep)


def apply_events(
    m: ModelState, w: WorkerState, events: list, orphan_grace: int, stats: ApplyStats, start: int = 0,
) -> ApplyStats:
    """Apply one batch of one worker, in order. Never raises for bad data: it counts it.

    `start`: events before it were already applied (by the accelerator's whole-batch walk) into `stats`."""
    try:
        digests = _precompute(m, w, events[start:] if start else events)
    except (TypeError, ValueError, AttributeError):
        digests = {}  # odd events in the batch: each is hashed (and judged) on its own below
    for i in range(start, len(events)):
        ev = events[i]
        cls = type(ev)
        try:
            if cls is BlockStored:
                _store(m, w, ev, digests.get(i - start), stats)
            elif cls is BlockRemoved:
                _remove(m, w, ev, stats)
            elif cls is AllBlocksCleared or isinstance(ev, AllBlocksCleared):
                m.clear(w)
                stats.count(*CLEARED_KEY)
            elif cls is UndecodableEvent:
                stats.drop(ev.reason)
            else:
                stats.drop("bad_event")
        except (TypeError, ValueError, OverflowError, AttributeError):
            # A structurally odd event (wrong field types from a hand-built batch): count, go on.
            stats.drop("bad_event")
    _resolve_orphans(m, w, orphan_grace, stats)
    return stats


def decode_or_drop(payload: bytes, stats: ApplyStats) -> KVEventBatch | None:
    """The full decoder's verdict on a payload: the batch, or None with its `decode_<reason>` drop counted.

    Every event is judged on its own: when the batch is refused for what may be one event (a wrong
    field type, an unknown event tag, an empty bytes hash) but its shell `[ts, events, dp_rank]` reads,
    each event is decoded alone and the refused ones become `UndecodableEvent("event_<reason>")`,
    counted where they stood, so one bad event never loses its neighbours (docs/index-core.md)."""
    batch = decode_batch(payload)
    if isinstance(batch, DecodeError):
        salvaged = _salvage(payload) if batch.reason in _PER_EVENT_REASONS else None
        if salvaged is None:
            stats.drop(f"decode_{batch.reason}")
        return salvaged
    return batch


def _salvage(payload: bytes) -> KVEventBatch | None:
    try:
        shell = _shell_decoder.decode(payload)
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError):
        return None  # the shell itself is bad: the whole payload is refused
    ts = _encode(shell.ts)
    events: list = []
    for raw in shell.events:
        # the full decoder on a one-event batch: the same rules (forms, normalisation) per event
        one = decode_batch(b"\x92" + ts + b"\x91" + bytes(raw))
        if isinstance(one, DecodeError):
            events.append(UndecodableEvent(f"event_{one.reason}"))
        else:
            events.extend(one.events)
    return KVEventBatch(shell.ts, events, shell.data_parallel_rank)


def finite_ts(ts: float) -> float:
    """A batch's ts as the stats report it: NaN and infinities (no usable time) become 0.0 (unknown)."""
    return ts if math.isfinite(ts) else 0.0
