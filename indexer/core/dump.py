"""Whole-state dump as events, and rebuild from such a dump (the basis of snapshots).

Block contents are not kept (only content keys), so a dump cannot carry token ids. Each worker's
state is written as one `BlockStored` per tier with `block_size=0`, `token_ids=[]`, the engine hashes
in `block_hashes`, the matching content keys (u64) in `extra_keys`, and the marker
`kv_cache_spec_kind="kvatlas_dump"`. Only `load_dump` understands these; fed to `apply` they are
skipped and counted (non-full-attention kind), never misapplied.
"""
from __future__ import annotations

from typing import Any

from indexer.core.state import NIBBLE, ModelState
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


def load_model_dump(m: ModelState, dump: list[tuple[str, int, list[KVEvent]]]) -> int:
    """Add a dump's state to `m` (normally empty). Returns entries loaded; malformed events are skipped."""
    loaded = 0
    nodes = m.nodes
    for worker_id, dp_rank, events in dump:
        w = m.worker(str(worker_id), int(dp_rank))
        for ev in events:
            if not isinstance(ev, BlockStored) or ev.kv_cache_spec_kind != DUMP_KIND:
                continue
            keys = ev.extra_keys or []
            if len(keys) != len(ev.block_hashes) or ev.medium not in MEDIUM_NAMES:
                continue
            bit = 1 << (w.shift + MEDIUM_NAMES.index(ev.medium))
            for h, key in zip(ev.block_hashes, keys):
                if type(key) is not int or not 0 <= key <= MASK64:
                    continue  # content keys are u64; anything else is not ours
                w.ext[h] = key
                nodes[key] = nodes.get(key, 0) | bit
                loaded += 1
    return loaded
