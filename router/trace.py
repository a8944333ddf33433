"""Request traces for replay: Mooncake-format JSONL, a bounded conversation-preserving slice of it,
deterministic expansion of block hash ids into token ids, and a built-in multi-turn generator.

Pure functions over plain data (docs/end-to-end.md, "The trace"). No I/O beyond reading the file.
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec
import numpy as np

TRACE_BLOCK_TOKENS = 512  # Mooncake traces: one hash id per 512-token block
VOCAB = 32_000
DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "tests" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"


class TraceError(ValueError):
    """A trace file or line that cannot be used; the message names the line."""


class TraceRequest(msgspec.Struct, frozen=True):
    """One request of a trace. `arrival_s` is seconds from the start of the replay."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class _Line(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def parse_trace(lines: Iterable[str | bytes], block_tokens: int = TRACE_BLOCK_TOKENS) -> list[TraceRequest]:
    """Mooncake JSONL → requests in file order, arrivals in seconds from the first one."""
    dec = msgspec.json.Decoder(_Line)
    out: list[TraceRequest] = []
    t0: float | None = None
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = dec.decode(line)
        except msgspec.DecodeError as exc:
            raise TraceError(f"trace line {no}: {exc}") from None
        if r.input_length <= 0 or r.output_length < 0 or r.timestamp < 0:
            raise TraceError(f"trace line {no}: lengths must be positive and timestamp >= 0")
        need = -(-r.input_length // block_tokens)
        if len(r.hash_ids) != need or any(h < 0 for h in r.hash_ids):
            raise TraceError(f"trace line {no}: input_length {r.input_length} needs {need} non-negative "
                             f"hash ids of {block_tokens} tokens, got {len(r.hash_ids)}")
        t0 = r.timestamp if t0 is None else t0
        out.append(TraceRequest(len(out), (r.timestamp - t0) / 1000.0, r.input_length, r.output_length,
                                tuple(r.hash_ids)))
    if not out:
        raise TraceError("trace is empty")
    return out


def load_trace(path: str | Path | None = None) -> list[TraceRequest]:
    p = Path(path) if path else DEFAULT_TRACE
    try:
        with p.open("rb") as f:
            return parse_trace(f)
    except OSError as exc:
        raise TraceError(f"cannot read trace {p}: {exc}") from None


def slice_conversations(reqs: Sequence[TraceRequest], n: int, seed: int = 0,
                        keep_rate: bool = True) -> list[TraceRequest]:
    """A bounded slice that keeps whole conversations: requests are grouped by their first hash id
    (turns of one conversation share it), groups are drawn in a seeded order until `n` requests are
    taken, and time order is restored. A contiguous window would cut conversations apart (their
    turns are minutes apart), leaving almost no reuse. With `keep_rate` the timeline is compressed
    by len(reqs)/len(slice) so the slice arrives at the full trace's request rate."""
    if n <= 0:
        raise ValueError("slice size must be positive")
    if n >= len(reqs):
        return list(reqs)
    groups: dict[int, list[TraceRequest]] = {}
    for r in reqs:
        groups.setdefault(r.hash_ids[0], []).append(r)
    order = sorted(groups, key=lambda h: hashlib.blake2b(f"{seed}:{h}".encode(), digest_size=8).digest())
    chosen: list[TraceRequest] = []
    for h in order:
        if len(chosen) >= n:
            break
        chosen.extend(groups[h][: n - len(chosen)])
    chosen.sort(key=lambda r: (r.arrival_s, r.index))
    scale = len(chosen) / len(reqs) if keep_rate else 1.0
    t0 = chosen[0].arrival_s
    return [TraceRequest(i, (r.arrival_s - t0) * scale, r.input_length, r.output_length, r.hash_ids)
            for i, r in enumerate(chosen)]


def block_tokens(hash_id: int, block: int = TRACE_BLOCK_TOKENS) -> np.ndarray:
    """The token ids of one trace block: a PRNG seeded by the hash id, so equal ids → equal tokens."""
    rng = np.random.Generator(np.random.PCG64(hash_id))
    return rng.integers(1, VOCAB, size=block, dtype=np.uint32)


class TokenExpander:
    """Expands requests to token ids, caching each block's tokens (traces reuse blocks a lot)."""

    __slots__ = ("block", "_cache")

    def __init__(self, block: int = TRACE_BLOCK_TOKENS) -> None:
        self.block = block
        self._cache: dict[int, np.ndarray] = {}

    def tokens(self, req: TraceRequest) -> np.ndarray:
        parts = []
        for h in req.hash_ids:
            t = self._cache.get(h)
            if t is None:
                t = self._cache[h] = block_tokens(h, self.block)
            parts.append(t)
        return np.concatenate(parts)[: req.input_length] if parts else np.zeros(0, np.uint32)


class HashIds:
    """Fresh block hash ids for a generated trace: consecutive from `start` (each generator starts
    apart from the others', so traces never share a block by accident)."""

    __slots__ = ("next",)

    def __init__(self, start: int) -> None:
        self.next = start

    def __call__(self, k: int) -> list[int]:
        ids = list(range(self.next, self.next + k))
        self.next += k
        return ids


def multi_turn(conversations: int = 40, turns: int = 4, system_blocks: int = 4, systems: int = 3,
               turn_blocks: tuple[int, int] = (2, 8), output_length: int = 64, rate: float = 2.0,
               seed: int = 0) -> list[TraceRequest]:
    """Built-in generator in the trace's own shape: conversations share one of a few system prompts,
    and each turn's prompt is the previous prompt plus new blocks (so turns extend a prefix).
    Arrivals are Poisson at `rate` requests/s, turns of a conversation in order."""
    rng = random.Random(seed)
    fresh = HashIds(0)

    sys_prompts = [fresh(system_blocks) for _ in range(systems)]
    pending: list[list[list[int]]] = []
    for _ in range(conversations):
        prompt = list(rng.choice(sys_prompts))
        convo = []
        for _ in range(turns):
            prompt = prompt + fresh(rng.randint(*turn_blocks))
            convo.append(list(prompt))
        pending.append(convo)
    out: list[TraceRequest] = []
    t = 0.0
    while any(pending):
        live = [c for c in pending if c]
        convo = rng.choice(live)
        ids = convo.pop(0)
        t += rng.expovariate(rate)
        out.append(TraceRequest(len(out), t, len(ids) * TRACE_BLOCK_TOKENS - rng.randrange(TRACE_BLOCK_TOKENS),
                                output_length, tuple(ids)))
    return out


def bursty_chat(requests: int = 400, seed: int = 0, system_blocks: int = 8, first_blocks: tuple[int, int] = (6, 28),
                turn_blocks: tuple[int, int] = (1, 4), turns: tuple[int, int] = (2, 7),
                burst_every_s: float = 8.0, burst_size: tuple[int, int] = (3, 12), burst_gap_s: float = 0.04,
                think_s: tuple[float, float] = (3.0, 15.0), output_length: int = 64) -> list[TraceRequest]:
    """`builtin-chat`: a bursty shared-prefix chat workload, deterministic for a seed.

    Every conversation starts with one system prompt (`system_blocks` blocks of 512 tokens, shared by
    all). Conversations open in bursts (a burst every ~`burst_every_s`, exponential; each opens
    `burst_size` conversations `burst_gap_s` apart); the first user turn is long (a pasted document,
    `first_blocks`), each later turn is the previous prompt plus a reply and a new message
    (`turn_blocks`), sent a think time (`think_s`, uniform) after the previous turn. Mean prompt
    ~13k tokens with the defaults. The first `requests` requests by arrival are kept."""
    if requests <= 0:
        raise ValueError("requests must be positive")
    rng = random.Random(seed)
    fresh = HashIds(1 << 30)  # apart from the bundled trace's ids

    system = fresh(system_blocks)
    events: list[tuple[float, int, list[int]]] = []  # (arrival, conversation, hash ids)
    t = 0.0
    convo = 0
    # Later bursts start at or after `t`: once `requests` events precede it, the first ones are final.
    while sum(1 for e in events if e[0] < t) < requests:
        for j in range(rng.randint(*burst_size)):
            at = t + j * burst_gap_s * rng.uniform(0.5, 1.5)
            prompt = system + fresh(rng.randint(*first_blocks))
            for k in range(rng.randint(*turns)):
                if k:
                    at += rng.uniform(*think_s)
                    prompt = prompt + fresh(rng.randint(*turn_blocks))
                events.append((at, convo, list(prompt)))
            convo += 1
        t += rng.expovariate(1.0 / burst_every_s)
    events.sort(key=lambda e: (e[0], e[1]))
    out = []
    for i, (at, _, ids) in enumerate(events[:requests]):
        length = len(ids) * TRACE_BLOCK_TOKENS - rng.randrange(TRACE_BLOCK_TOKENS)
        out.append(TraceRequest(i, round(at - events[0][0], 6), length, output_length, tuple(ids)))
    return out


def conversations(requests: int = 300, seed: int = 0, systems: int = 4, system_blocks: tuple[int, int] = (4, 12),
                  first_blocks: tuple[int, int] = (8, 40), turns: tuple[int, int] = (3, 9),
                  answer_tokens: tuple[int, int] = (64, 512), message_blocks: tuple[int, int] = (1, 3),
                  start_rate: float = 0.8, think_s: tuple[float, float] = (2.0, 12.0),
                  decode_s_per_token: float = 0.02) -> list[TraceRequest]:
    """`builtin-conversation`: long multi-turn conversations, deterministic for a seed.

    Unlike `builtin-chat`: a few system prompts of different lengths with skewed popularity (the
    i-th is picked with weight 1/(i+1)), conversations open one at a time (Poisson, `start_rate`
    per second, no bursts), last `turns` turns, and each turn's prompt is the previous prompt + its
    answer (`answer_tokens`, the previous request's `output_length`, rounded up to whole blocks) +
    a new message (`message_blocks`). The next turn arrives a think time (`think_s`, uniform) after
    the previous answer ends on a nominal clock (arrival + answer tokens x `decode_s_per_token`),
    so contexts grow long (mean prompt ~20k tokens, up to ~35k with the defaults) and a
    conversation's next turn comes back while its cache is still warm somewhere. The first
    `requests` requests by arrival are kept."""
    if requests <= 0:
        raise ValueError("requests must be positive")
    rng = random.Random(seed)
    fresh = HashIds(3 << 29)  # apart from the bundled trace's and builtin-chat's ids

    prompts = [fresh(rng.randint(*system_blocks)) for _ in range(systems)]
    weights = [1.0 / (i + 1) for i in range(systems)]
    events: list[tuple[float, int, list[int], int]] = []  # (arrival, conversation, hash ids, output tokens)
    t = 0.0
    convo = 0
    while sum(1 for e in events if e[0] < t) < requests:  # later conversations start at or after `t`
        at = t
        prompt = rng.choices(prompts, weights)[0] + fresh(rng.randint(*first_blocks))
        for k in range(rng.randint(*turns)):
            answer = rng.randint(*answer_tokens)
            events.append((at, convo, list(prompt), answer))
            at += answer * decode_s_per_token + rng.uniform(*think_s)
            prompt = prompt + fresh(-(-answer // TRACE_BLOCK_TOKENS) + rng.randint(*message_blocks))
        convo += 1
        t += rng.expovariate(start_rate)
    events.sort(key=lambda e: (e[0], e[1]))
    out = []
    for i, (at, _, ids, answer) in enumerate(events[:requests]):
        length = len(ids) * TRACE_BLOCK_TOKENS - rng.randrange(TRACE_BLOCK_TOKENS)
        out.append(TraceRequest(i, round(at - events[0][0], 6), length, answer, tuple(ids)))
    return out


BUILTIN_TRACES = ("builtin", "builtin-chat", "builtin-conversation")


def requests_for(trace: str | None, n: int = 0, seed: int = 0) -> list[TraceRequest]:
    """A replay's requests: `builtin` (multi_turn), `builtin-chat` (bursty_chat, `n` requests, 400 if
    0), `builtin-conversation` (conversations, `n` requests, 300 if 0), or a Mooncake JSONL file (None: the bundled one), sliced to `n` whole conversations if n > 0."""
    if trace == "builtin-chat":
        return bursty_chat(n or 400, seed=seed)
    if trace == "builtin-conversation":
        return conversations(n or 300, seed=seed)
    reqs = multi_turn(seed=seed) if trace == "builtin" else load_trace(trace)
    return slice_conversations(reqs, n, seed=seed) if n else reqs
