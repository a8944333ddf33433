"""Random raw event payloads, odd ones included (array-form events, group fields), for the native
whole-batch path against the pure core (test_index_fastpath, test_fuzz_native), and the index state
both must agree on."""
from __future__ import annotations

import random

import msgspec

from indexer.index import KVIndex
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 2
MODEL = "m"
WORKERS = [("a", 0), ("b", 0), ("a", 1)]
MEDIA = [None, "GPU", "GPU", "CPU_PINNED", "cpu", " CPU_PINNED\t", "DISK", "nvme", "EXTERNAL", "shared", "bogus", "ＧＰＵ"]
KINDS = [None, None, "full_attention", "MLA", "sliding_window", "full_sliding", "mamba"]


def random_hash(rng: random.Random, pool: list) -> object:
    r = rng.random()
    if r < 0.85:
        return rng.choice(pool)
    if r < 0.9:
        return rng.choice([0, -1, 2**64 - 1, -(2**63)])
    if r < 0.97:
        return rng.getrandbits(64)
    return b"" if rng.random() < 0.5 else b"\x00" * 3


def random_tokens(rng: random.Random, blocks: list[list[int]], nblk: int) -> list:
    toks = [t for _ in range(nblk) for t in rng.choice(blocks)]
    r = rng.random()
    if r < 0.1:
        toks = toks[: max(0, len(toks) - rng.randint(1, BS))]  # partial trailing block
    elif r < 0.13 and toks:
        toks[rng.randrange(len(toks))] = rng.choice([1.5, "x", None, 2**64 - 1, -(2**63), True])
    return toks


def random_stored(rng: random.Random, pool: list, blocks: list[list[int]]) -> dict:
    n = rng.randint(1, 4)
    hashes = [random_hash(rng, pool) for _ in range(n)]
    placeholder = rng.random() < 0.15
    ev: dict = {"type": "BlockStored", "block_hashes": hashes,
                "parent_block_hash": None if rng.random() < 0.4 else random_hash(rng, pool),
                "token_ids": [] if placeholder else random_tokens(rng, blocks, n),
                "block_size": 0 if placeholder else rng.choice([BS, BS, BS, BS, 3, -1])}
    for key, choices in (("lora_id", [None, 3]), ("medium", MEDIA), ("lora_name", [None, "l"]),
                         ("cache_salt", [None, "s"]), ("session_id", [None, "sess"]),
                         ("extra_keys", [None, [], [None] * n, [None] * (n + 1), [["img", 1]] + [None] * (n - 1)]),
                         ("group_idx", [None, 0, 1, 1, 2]), ("kv_cache_spec_kind", KINDS),
                         ("kv_cache_spec_sliding_window", [None, 128]), ("locality", [None, "node"]),
                         ("ownership", [None, "own"])):
        if rng.random() < 0.35:
            ev[key] = rng.choice(choices[:2] if rng.random() < 0.7 else choices)
    return ev


def random_event(rng: random.Random, pool: list, blocks: list[list[int]]) -> object:
    r = rng.random()
    if r < 0.55:
        ev = random_stored(rng, pool, blocks)
    elif r < 0.93:
        ev = {"type": "BlockRemoved", "block_hashes": [random_hash(rng, pool) for _ in range(rng.randint(1, 3))]}
        if rng.random() < 0.7:
            ev["medium"] = rng.choice(MEDIA)
        if rng.random() < 0.3:
            ev["group_idx"] = rng.choice([0, 1, 1, 2])
    else:
        ev = {"type": "AllBlocksCleared"}
    odd = rng.random()
    if odd < 0.03:
        ev["unknown_field"] = [1, {"x": 2}]
    elif odd < 0.05:  # tag not first
        ev = dict(reversed(list(ev.items())))
    elif odd < 0.07:
        return [ev["type"], *[v for k, v in ev.items() if k != "type"]]  # array form
    elif odd < 0.08:
        ev["type"] = "BlockEvicted"
    return ev


FIELDS = {t: [f for f in cls.__struct_fields__] for t, cls in (
    ("BlockStored", BlockStored), ("BlockRemoved", BlockRemoved), ("AllBlocksCleared", AllBlocksCleared))}


def positional(rng: random.Random, ev: object) -> object:
    """A map event in vLLM's array-like form: the tag, then the fields in declaration order (trailing
    absent ones omitted, sometimes written as nil, sometimes followed by extra elements)."""
    if not isinstance(ev, dict) or ev.get("type") not in FIELDS or set(ev) - {"type", *FIELDS[ev["type"]]}:
        return ev
    names = FIELDS[ev["type"]]
    vals = [ev.get(f) for f in names]
    last = max((i for i, f in enumerate(names) if f in ev), default=-1)
    keep = len(names) if rng.random() < 0.2 else last + 1 + rng.randint(0, 1)
    out = [ev["type"], *vals[:keep]]
    if rng.random() < 0.1:
        out += [rng.choice([None, 7, "x", [1, {"y": 2}]])]  # past the declared fields: ignored
    return out


def random_payload(rng: random.Random, pool: list, blocks: list[list[int]]) -> bytes:
    events = [random_event(rng, pool, blocks) for _ in range(rng.randint(0, 5))]
    if rng.random() < 0.35:  # the whole batch in the array-like form (vLLM before maps, Dynamo)
        events = [positional(rng, ev) for ev in events]
    r = rng.random()
    if r < 0.03:
        batch: list = [0, events]
    elif r < 0.05:
        batch = [0.0, events, 0, "extra"]
    else:
        batch = [1.5, events, rng.choice([None, 0])]
    raw = msgspec.msgpack.encode(batch)
    if rng.random() < 0.02:
        raw += b"\x00"
    return raw


def digests_of(d: object) -> list[int]:
    return list(memoryview(d).cast("Q")) if isinstance(d, bytes) else list(d)  # native keeps them packed


def index_state(ix: KVIndex) -> tuple:
    m = ix._models[MODEL]
    workers = {
        k: (sorted(w.ext.items(), key=repr),
            [(p.hashes, p.parent, digests_of(p.digests), p.tier, p.age, p.cancelled) for p in w.pending])
        for k, w in m.by_id.items()
    }
    layouts = {  # group layouts and residency (docs/hybrid.md): the C walk stops at group events
        k: None if w.layout is None else (w.layout.primary, {
            gi: (g.kind, g.window, sorted(g.ext.get(w.slot, {}).items(), key=repr),
                 sorted(((key, (g.nodes.get(key, 0) >> w.shift) & 15) for key in g.ext.get(w.slot, {}).values()), key=repr))
            for gi, g in w.layout.groups.items()})
        for k, w in m.by_id.items()
    }
    return sorted(m.nodes.items(), key=repr), workers, sorted(m.known_ext.items(), key=repr), layouts
