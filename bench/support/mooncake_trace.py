"""A seeded Mooncake-trace-shaped workload and the KV event stream a routed cluster makes of it.

The Mooncake trace (kvcache-ai/Mooncake `mooncake_trace.jsonl`, FAST'25) is JSONL, one request a line:
`{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}` where each
hash id names one 512-token block of the prompt (the last one partial), ids are handed out in order of
first appearance, and two requests sharing a prefix share its leading ids (e.g. `[0, 1, ..., 13]` and
`[0, 14, ...]`: a shared one-block system prompt; `[46, ..., 57, 2353, 2354]` and `[46, ..., 57, 2366]`:
a conversation's next turn). The file is not reachable here, so `generate` makes one of the same shape.
Shape parameters (`Shape`) and why:
- 23,608 requests over one hour (timestamps 0..3.6M ms, Poisson arrivals): the published trace's size.
- Mean input ~7.6k tokens, mean output ~180 tokens: the Mooncake paper's trace statistics (avg input
  7,590, avg output 182); inputs lognormal (long tail, capped at 128k, Kimi's context), so most
  prompts are 2-30 blocks and a few are hundreds.
- Heavy prefix sharing: a request continues an earlier conversation (its previous prompt's full
  blocks, then a few new blocks: the next turn) with probability `p_continue`, else it opens a new
  one on one of `n_system` system prompts (1-4 blocks, Zipf popularity) — the two patterns the
  published samples show. `prefix_reuse` (printed by the bench) is the fraction of prompt blocks seen
  before; ~0.5-0.6 with these settings, the order of the sharing the paper reports for Kimi.

`Cluster` replays the records on `workers` engines: each request is scored first (its longest resident
prefix per worker: the lookup), routed to the best match less a load penalty, its full blocks past that
match are stored there (BlockStored, parent = the last matched block) and, over the worker's capacity,
its least recently used blocks are evicted (BlockRemoved). Blocks of one request are touched tail
first, so a prefix block is always more recent than its descendants and LRU evicts leaves first, as
engines do. Decode blocks are not modelled (182 output tokens rarely fill a 512-token block).
`Step.expected` is the reference answer of each lookup (matched blocks per worker), what an exact
index must answer.
"""
from __future__ import annotations

from collections import OrderedDict

import msgspec
import numpy as np

BLOCK = 512
VOCAB = 150_000
MASK = (1 << 64) - 1


class Record(msgspec.Struct):
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]


class Shape(msgspec.Struct, frozen=True):
    n_requests: int = 23_608
    duration_ms: int = 3_600_000
    input_median: float = 5_600.0  # lognormal median, sigma below: mean of new prompts ~7.1k tokens
    input_sigma: float = 0.7
    max_input: int = 131_072
    output_median: float = 100.0  # lognormal: mean ~180
    output_sigma: float = 1.1
    p_continue: float = 0.5
    turn_blocks_mean: float = 2.0  # new blocks per conversation turn (geometric)
    live_sessions: int = 512  # a continuing request picks one of the most recent conversations
    n_system: int = 32
    zipf_a: float = 1.2


class Step(msgspec.Struct):
    """One request as the cluster sees it: lookup `blocks` (full blocks' hash ids), then store
    `blocks[stored_from:]` on `worker`, then remove `removed` there."""
    worker: int
    blocks: list[int]
    stored_from: int
    removed: list[int]
    expected: list[int] | None  # matched blocks per worker before this request (reference), or None


def generate(shape: Shape = Shape(), seed: int = 0) -> list[Record]:
    rng = np.random.default_rng(seed)
    next_id = 0
    sys_len = rng.integers(1, 5, shape.n_system)
    system: dict[int, list[int]] = {}  # ids handed out on first use, as the trace's are
    pop = 1.0 / np.arange(1, shape.n_system + 1) ** shape.zipf_a
    pop /= pop.sum()
    sessions: list[list[int]] = []  # full-block ids of each live conversation's last prompt
    out: list[Record] = []
    # a Poisson process given its count: sorted uniform arrival times over the duration
    arrivals = np.sort(rng.integers(0, shape.duration_ms, shape.n_requests))
    for i in range(shape.n_requests):
        ts = int(arrivals[i])
        if sessions and rng.random() < shape.p_continue:
            k = int(rng.integers(0, len(sessions)))
            prefix = sessions[k]
            n_new = int(rng.geometric(1.0 / shape.turn_blocks_mean))
            length = (len(prefix) + n_new) * BLOCK - int(rng.integers(0, BLOCK))
        else:
            k = -1
            j = int(rng.choice(shape.n_system, p=pop))
            if j not in system:
                system[j] = list(range(next_id, next_id + int(sys_len[j])))
                next_id += int(sys_len[j])
            prefix = system[j]
            length = int(rng.lognormal(np.log(shape.input_median), shape.input_sigma))
            length = max(length, len(prefix) * BLOCK + 1)
        length = min(length, shape.max_input)
        n_ids = -(-length // BLOCK)
        keep = min(len(prefix), n_ids)
        ids = prefix[:keep] + list(range(next_id, next_id + n_ids - keep))
        next_id += n_ids - keep
        full = ids[: length // BLOCK]
        if k >= 0:
            sessions[k] = full
        else:
            sessions.append(full)
            if len(sessions) > shape.live_sessions:
                sessions.pop(0)
        o = max(1, int(rng.lognormal(np.log(shape.output_median), shape.output_sigma)))
        out.append(Record(ts, length, o, ids))
    return out


def prefix_reuse(records: list[Record]) -> float:
    """Fraction of full prompt blocks that appeared in an earlier request (the sharing an infinite
    cache could exploit)."""
    seen: set[int] = set()
    hit = total = 0
    for r in records:
        full = r.hash_ids[: r.input_length // BLOCK]
        total += len(full)
        hit += sum(1 for h in full if h in seen)
        seen.update(full)
    return hit / max(1, total)


class Cluster:
    """The reference: per-worker LRU residency of block hash ids, KV-aware routing."""

    __slots__ = ("lru", "capacity", "recent", "window")

    def __init__(self, workers: int, capacity: int, window: int = 64) -> None:
        self.lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(workers)]
        self.capacity = capacity
        self.recent: list[int] = []  # the last `window` routing choices (load)
        self.window = window

    def matches(self, blocks: list[int]) -> list[int]:
        out = []
        for res in self.lru:
            n = 0
            for h in blocks:
                if h not in res:
                    break
                n += 1
            out.append(n)
        return out

    def step(self, blocks: list[int], keep_expected: bool) -> Step:
        m = self.matches(blocks)
        load = [0] * len(self.lru)
        for w in self.recent:
            load[w] += 1
        w = max(range(len(m)), key=lambda i: (m[i] - 0.5 * load[i], -i))
        self.recent.append(w)
        if len(self.recent) > self.window:
            self.recent.pop(0)
        res = self.lru[w]
        for h in reversed(blocks):  # tail first: the prefix ends most recent
            res[h] = None
            res.move_to_end(h)
        removed = []
        while len(res) > self.capacity:
            removed.append(res.popitem(last=False)[0])
        return Step(w, blocks, m[w], removed, m if keep_expected else None)


def steps(records: list[Record], workers: int, capacity: int, keep_expected: bool = False) -> list[Step]:
    c = Cluster(workers, capacity)
    return [c.step(r.hash_ids[: r.input_length // BLOCK], keep_expected) for r in records]


def final_residency(records: list[Record], workers: int, capacity: int) -> list[set[int]]:
    c = Cluster(workers, capacity)
    for r in records:
        c.step(r.hash_ids[: r.input_length // BLOCK], False)
    return [set(x) for x in c.lru]


def block_tokens(hid: int) -> np.ndarray:
    """The 512 tokens of block `hid`: distinct for distinct ids (the first two tokens spell the id)."""
    t = (np.arange(BLOCK, dtype=np.uint64) * 7919 + hid * 104_729) % VOCAB
    t[0], t[1] = hid % VOCAB, hid // VOCAB
    return t.astype(np.uint32)


def engine_hash(hid: int) -> int:
    """The engine's block hash for `hid` (any 64-bit value unique per id serves)."""
    return ((hid + 1) * 0x9E3779B97F4A7C15) & MASK
