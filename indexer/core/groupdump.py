"""Group state in dumps (snapshots) and back (indexer/core/groups.py, docs/hybrid.md).

Group state rides in a worker's dump as placeholder-shaped stores whose kind is the dump marker plus
a letter (no full / sliding / mamba marker in it, so `apply` skips them): one header per group of
the worker's own layout (its main group first, then each group with its kind and window, even when
empty), then one store per group and tier with the engine hashes and their content keys in
`extra_keys`, like indexer/core/dump.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from indexer.core.dump import PutEntries, put_entries
from indexer.core.groups import FULL, Layout, table
from indexer.core.state import NIBBLE
from indexer.core.types import MEDIUM_NAMES
from schemas.events import BlockStored

if TYPE_CHECKING:
    from indexer.core.state import ModelState, WorkerState

DUMP_GROUP = "kvatlas_dump/"
_LETTERS = "FSM"  # FULL, SWA, MAMBA


def layout_heads(lay: Layout) -> list[BlockStored]:
    """The dump's head events of one worker's layout: its main group, its groups, kinds and windows."""
    heads = []
    if lay.primary is not None:
        heads.append(BlockStored([], None, [], 0, medium="GPU", group_idx=lay.primary, kv_cache_spec_kind=DUMP_GROUP + "F"))
    for gi, g in lay.groups.items():
        heads.append(BlockStored([], None, [], 0, medium="GPU", group_idx=gi, kv_cache_spec_kind=DUMP_GROUP + _LETTERS[g.kind],
                                 kv_cache_spec_sliding_window=g.window))
    return heads


def _worker_groups(w: WorkerState) -> list[Any]:
    lay = w.layout
    if lay is None:
        return []
    evs: list[Any] = layout_heads(lay)
    for gi, g in lay.groups.items():
        gext = g.ext.get(w.slot)
        if not gext:
            continue
        per_tier: list[tuple[list[Any], list[int]]] = [([], []) for _ in range(4)]
        for h, key in gext.items():
            bits = (g.nodes.get(key, 0) >> w.shift) & NIBBLE
            for tier in range(4):
                if bits >> tier & 1:
                    per_tier[tier][0].append(h)
                    per_tier[tier][1].append(key)
        for tier, (hs, ks) in enumerate(per_tier):
            if hs:
                evs.append(BlockStored(hs, None, [], 0, medium=MEDIUM_NAMES[tier], extra_keys=ks, group_idx=gi,
                                       kv_cache_spec_kind=DUMP_GROUP + _LETTERS[g.kind]))
    return evs


def dump_groups(m: ModelState, out: list[tuple[str, int, list[Any]]]) -> None:
    """Each worker's layout and group residency appended to its entry of `out` (dump_model's)."""
    by_id = {(wid, r): evs for wid, r, evs in out}
    for w in m.workers:
        if w is None:
            continue
        evs = by_id.get((w.worker_id, w.dp_rank))
        if evs is not None:
            evs.extend(_worker_groups(w))


def load_groups(m: ModelState, dump: list[tuple[str, int, list[Any]]], put: PutEntries = put_entries) -> int:
    """The group part of a dump (`dump_groups`) into `m`; returns group entries loaded. `put` loads one
    store's entries (dump.py's `put_entries`, or the accelerator's one call per store)."""
    loaded = 0
    for worker_id, dp_rank, events in dump:
        for ev in events:
            kind = ev.kv_cache_spec_kind if isinstance(ev, BlockStored) else None
            if not (isinstance(kind, str) and kind.startswith(DUMP_GROUP) and kind[len(DUMP_GROUP):] in _LETTERS):
                continue
            code = _LETTERS.index(kind[len(DUMP_GROUP):])
            gi = ev.group_idx
            if type(gi) is not int or gi < 0 or ev.medium not in MEDIUM_NAMES:
                continue
            w = m.worker(str(worker_id), int(dp_rank))
            lay = w.layout
            if lay is None:
                lay = w.layout = Layout(None)
                table(m).version += 1
            if code == FULL and lay.primary is None and gi not in lay.groups:
                lay.primary = gi
            if gi == lay.primary:
                continue
            g = lay.groups.get(gi)
            if g is None:
                win = ev.kv_cache_spec_sliding_window
                g = table(m).join(m, w, gi, code, win if type(win) is int and code != FULL else None)
                if g is None:
                    continue
            if not ev.block_hashes:
                continue
            keys = ev.extra_keys or []
            if len(keys) != len(ev.block_hashes):
                continue
            loaded += put(g.nodes, g.slot_map(w.slot), ev.block_hashes, keys, w.shift + MEDIUM_NAMES.index(ev.medium))
    return loaded
