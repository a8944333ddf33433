"""Random producer-like histories for the index property tests (test_index_property,
test_sharded_index): simulated workers emitting store/remove/clear batches, deliveries perturbed
by duplication and bounded reordering, queries over the prompts, and the equality check against the
brute-force reference."""
from __future__ import annotations

import hashlib
import random

from indexer.index import KVIndex
from schemas.codec import encode_batch
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from support.reference import ReferenceIndex

BS = 4
MODEL = "m"
WORKERS = [("w0", 0), ("w0", 1), ("w1", 0), ("w2", 0)]
HOST_NAMES = ["CPU_PINNED", "CPU"]  # SGLang / vLLM spelling (the codec canonicalises; apply accepts both)


class SimWorker:
    """A producer's view: identity (namespace + every block from the root) -> set of tiers."""

    def __init__(self, key: tuple[str, int], salt: str | None, bytes_hashes: bool) -> None:
        self.key = key
        self.salt = salt
        self.bytes_hashes = bytes_hashes
        self.blocks: dict[tuple, set[int]] = {}
        self.events: list = []

    def ext(self, ident: tuple):
        d = hashlib.blake2b(repr((self.salt, ident)).encode(), digest_size=16).digest()
        return d if self.bytes_hashes else int.from_bytes(d[:8], "little")

    def held(self, tier: int) -> list[tuple]:
        return sorted((i for i, ts in self.blocks.items() if tier in ts), key=repr)


def make_prompts(rng: random.Random) -> list[tuple[list[int], list | None]]:
    prefixes = [[rng.randrange(1000) for _ in range(BS * rng.randint(1, 4))] for _ in range(3)]
    prompts = []
    for i in range(8):
        toks = list(prefixes[i % 3]) + [rng.randrange(1000) for _ in range(BS * rng.randint(0, 3) + rng.randint(0, 3))]
        nblk = len(toks) // BS
        extras = None
        if i == 5:  # a multimodal prompt: one block carries extra keys
            extras = [None] * nblk
            extras[min(1, nblk - 1)] = ["img", 7]
        prompts.append((toks, extras))
    return prompts


def idents_of(toks, extras, lora):
    out = []
    prefix: tuple = ((lora, None),)
    for i in range(len(toks) // BS):
        import msgspec

        x = extras[i] if extras else None
        prefix = prefix + ((tuple(toks[i * BS : (i + 1) * BS]), None if x is None else msgspec.msgpack.encode(x)),)
        out.append(prefix)
    return out


def do_insert(w: SimWorker, toks, extras, lora, partial_tail: bool) -> None:
    ids = idents_of(toks, extras, lora)
    i = 0
    while i < len(ids):
        if 0 in w.blocks.get(ids[i], ()):
            i += 1
            continue
        j = i
        while j < len(ids) and 0 not in w.blocks.get(ids[j], ()):
            j += 1
        hashes = [w.ext(x) for x in ids[i:j]]
        tok = toks[i * BS : j * BS]
        xk = extras[i:j] if extras else None
        if partial_tail and j == len(ids) and len(toks) > j * BS:
            hashes.append(w.ext(("partial", ids[-1])))  # engines never do this; we must ignore it
            tok = toks[i * BS :]
            if xk is not None:
                xk = xk + [None]
        parent = w.ext(ids[i - 1]) if i > 0 else None
        w.events.append(BlockStored(hashes, parent, tok, BS, medium="GPU", lora_name=lora, extra_keys=xk))
        for x in ids[i:j]:
            w.blocks.setdefault(x, set()).add(0)
        i = j


def tokens_of(ident) -> list[int]:
    return list(ident[-1][0])


def do_tier(w: SimWorker, op: str, k: int, rng: random.Random) -> None:
    src = {"demote": 0, "evict_gpu": 0, "evict_host": 1, "backup_disk": 1, "evict_disk": 2,
           "share": 1, "unshare": 3}[op]
    held = w.held(src)
    if not held:
        return
    ident = held[k % len(held)]
    h = w.ext(ident)
    if op in ("demote", "backup_disk", "share"):
        tier = {"demote": 1, "backup_disk": 2, "share": 3}[op]
        medium = {1: rng.choice(HOST_NAMES), 2: "DISK", 3: "EXTERNAL"}[tier]
        if rng.random() < 0.5:  # placeholder form (vLLM offloading connector)
            w.events.append(BlockStored([h], None, [], 0, medium=medium))
        else:
            parent = w.ext(ident[:-1]) if len(ident) > 2 else None
            w.events.append(BlockStored([h], parent, tokens_of(ident), BS, medium=medium))
        w.blocks[ident].add(tier)
    else:
        tier = {"evict_gpu": 0, "evict_host": 1, "evict_disk": 2, "unshare": 3}[op]
        medium = {0: "GPU", 1: rng.choice(HOST_NAMES), 2: "DISK", 3: "EXTERNAL"}[tier]
        w.events.append(BlockRemoved([h], medium=medium))
        w.blocks[ident].discard(tier)
        if not w.blocks[ident]:
            del w.blocks[ident]


OPS = ["insert", "insert", "insert", "demote", "evict_gpu", "evict_host", "backup_disk", "evict_disk",
       "share", "unshare", "flush", "flush", "clear", "bogus", "skip_group", "api_clear", "api_remove"]


def touched(batch: KVEventBatch) -> set:
    out = set()
    for ev in batch.events:
        if isinstance(ev, AllBlocksCleared):
            return {"*"}
        out.update(ev.block_hashes)
        if isinstance(ev, BlockStored) and ev.parent_block_hash is not None:
            out.add(ev.parent_block_hash)
    return out


def build_history(seed: int, n_ops: int, trust: bool):
    rng = random.Random(seed)
    prompts = make_prompts(rng)
    sims = {k: SimWorker(k, None if trust else f"salt{k}", bytes_hashes=(k == ("w2", 0))) for k in WORKERS}
    deliveries: list = []  # ("batch", key, KVEventBatch) | ("clear"|"remove", key)

    def flush(w: SimWorker) -> None:
        if w.events:
            deliveries.append(("batch", w.key, KVEventBatch(0.0, w.events, w.key[1])))
            w.events = []

    for _ in range(n_ops):
        op = rng.choice(OPS)
        w = sims[rng.choice(WORKERS)]
        if op == "insert":
            toks, extras = rng.choice(prompts)
            do_insert(w, toks, extras, rng.choice([None, None, "lora-a"]), rng.random() < 0.2)
        elif op == "flush":
            flush(w)
        elif op == "clear":
            w.events.append(AllBlocksCleared())
            w.blocks.clear()
        elif op == "bogus":
            w.events.append(BlockRemoved([rng.getrandbits(64)], medium="GPU"))
        elif op == "skip_group":  # a sliding-window group's store: must be ignored
            toks, _ = rng.choice(prompts)
            w.events.append(BlockStored([rng.getrandbits(64)], None, toks[:BS], BS, medium="GPU",
                                        group_idx=1, kv_cache_spec_kind="sliding_window"))
        elif op in ("api_clear", "api_remove"):
            flush(w)
            deliveries.append(("clear" if op == "api_clear" else "remove", w.key))
            w.blocks.clear()
        else:
            do_tier(w, op, rng.randrange(1000), rng)
        if rng.random() < 0.3:
            flush(w)
    for w in sims.values():
        flush(w)
    return prompts, deliveries


def _parents(batch: KVEventBatch) -> set:
    return {ev.parent_block_hash for ev in batch.events if isinstance(ev, BlockStored) and ev.parent_block_hash is not None}


def _stored(batch: KVEventBatch) -> set:
    return {h for ev in batch.events if isinstance(ev, BlockStored) for h in ev.block_hashes}


def perturb(deliveries: list, rng: random.Random, dup_p: float, swap_p: float) -> list:
    out = list(deliveries)
    i = 0
    while i + 1 < len(out):
        a, b = out[i], out[i + 1]
        if a[0] == b[0] == "batch" and rng.random() < swap_p:
            same = a[1] == b[1]
            ta, tb = touched(a[2]), touched(b[2])
            # Within tolerance: a child's store may overtake its parent's (the orphan path).
            parent_first = (ta & tb) <= (_parents(b[2]) & _stored(a[2])) and not (_stored(b[2]) & ta)
            if not same or ("*" not in ta and "*" not in tb and (not (ta & tb) or parent_first)):
                out[i], out[i + 1] = b, a
                i += 2
                continue
        i += 1
    final = []
    for d in out:
        final.append(d)
        if d[0] == "batch" and rng.random() < dup_p:
            final.append(d)
    return final


def run(index, deliveries, via_payload: bool = False) -> list:
    stats = []
    for d in deliveries:
        if d[0] == "batch" and via_payload:  # the wire path: decode (fast raw decoder when native) + apply
            stats.append(index.apply_payload(MODEL, d[1][0], d[1][1], encode_batch(d[2])))
        elif d[0] == "batch":
            stats.append(index.apply(MODEL, d[1][0], d[1][1], d[2]))
        elif d[0] == "clear":
            index.clear_worker(MODEL, d[1][0], d[1][1])
        else:
            index.remove_worker(MODEL, d[1][0], d[1][1])
    return stats


def queries(prompts, rng: random.Random):
    for toks, extras in prompts:
        for lora in (None, "lora-a"):
            yield toks, lora, extras
            cut = rng.randint(0, len(toks))
            yield toks[:cut], lora, (extras[: cut // BS] if extras else None)
        if extras:
            yield toks, None, None  # token-only query must not match the multimodal block
    yield [rng.randrange(1000) for _ in range(12)], None, None


def check_equal(ix: KVIndex, ref: ReferenceIndex, prompts, rng: random.Random) -> None:
    for toks, lora, extras in queries(prompts, rng):
        for workers in (None, rng.sample(WORKERS, 2)):
            got = ix.score(MODEL, toks, lora_name=lora, workers=workers, extra_keys=extras)
            want = ref.score(MODEL, toks, lora_name=lora, workers=workers, extra_keys=extras)
            assert got == want, (toks, lora, workers)
    assert ix.worker_stats(MODEL) == ref.worker_stats(MODEL)
