"""Whole-state dump as events, and rebuild from such a dump (the basis of snapshots).

Block contents are not kept (only content keys), so a dump cannot carry token ids. Each worker's
state is written as one `BlockStored` per tier with `block_size=0`, `token_ids=[]`, the engine hashes
in `block_hashes`, the matching content keys (u64) in `extra_keys`, and the marker
`kv_cache_spec_kind="kvatlas_dump"`. Only `load_dump` understands these; fed to `apply` they are
skipped and counted (non-full-attention kind), never misapplied.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from indexer.core.state import NIBBLE, ModelState, WorkerState
from indexer.core.types import MEDIUM_NAMES
from indexer.hashing import MASK64
from schemas.events import BlockStored, KVEvent

DUMP_KIND = "kvatlas_dump"


def dump_model(m: ModelState) -> list[tuple[str, int, list[KVEvent]]]:
    out: list[tuple[str, int, list[KVEvent]]] = []
    nodes = m.nodes
    for w in m.workers:
        if w is None:
            continue
        per_tier: list[tuple[list[Any], list[int]]] = [([], []) for _ in range(4)]
        sh = w.shift
        for h, key in w.ext.items():
            bits = (nodes.get(key, 0) >> sh) & NIBBLE
            for t in range(4):
                if bits >> t & 1:
                    per_tier[t][0].append(h)
                    per_tier[t][1].append(key)
        events: list[KVEvent] = []
        for t, (hashes, keys) in enumerate(per_tier):
            if hashes:
                events.append(
                    BlockStored(
                        block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=0,
                        medium=MEDIUM_NAMES[t], extra_keys=keys, kv_cache_spec_kind=DUMP_KIND,
                    )
                )
        out.append((w.worker_id, w.dp_rank, events))
    return out


class Store(NamedTuple):
    """One well-formed dump store: its worker, tier, engine hashes and their content keys."""

    worker: WorkerState
    tier: int
    hashes: list[Any]
    keys: list[Any]


def dump_stores(m: ModelState, dump: list[tuple[str, int, list[KVEvent]]]) -> list[Store]:
    """The dump's stores `load_model_dump` takes, each worker registered (in dump order, so slots are
    those of a load entry by entry); malformed events are left out."""
    out = []
    for worker_id, dp_rank, events in dump:
        w = m.worker(str(worker_id), int(dp_rank))
        for ev in events:
            if not isinstance(ev, BlockStored) or ev.kv_cache_spec_kind != DUMP_KIND:
                continue
            keys = ev.extra_keys or []
            if len(keys) != len(ev.block_hashes) or ev.medium not in MEDIUM_NAMES:
                continue
            out.append(Store(w, MEDIUM_NAMES.index(ev.medium), ev.block_hashes, keys))
    return out


PutEntries = Callable[[Any, Any, list[Any], list[Any], int], int]


def put_entries(nodes: Any, ext: Any, hashes: list[Any], keys: list[Any], pos: int) -> int:
    """One store's entries: each hash maps to its key in `ext` and the key's node gets residency bit
    `pos`. Keys that are not u64 are skipped. Returns the entries loaded. The reference of the
    accelerator's `U64Map.load` (all of a dump's stores in one C call)."""
    bit = 1 << pos
    loaded = 0
    for h, key in zip(hashes, keys):
        if type(key) is not int or not 0 <= key <= MASK64:
            continue  # content keys are u64; anything else is not ours
        ext[h] = key
        nodes[key] = nodes.get(key, 0) | bit
        loaded += 1
    return loaded


def load_model_dump(m: ModelState, dump: list[tuple[str, int, list[KVEvent]]]) -> int:
    """Add a dump's state to `m` (normally empty). Returns entries loaded; malformed events are skipped."""
    return sum(put_entries(m.nodes, s.worker.ext, s.hashes, s.keys, s.worker.shift + s.tier) for s in dump_stores(m, dump))
