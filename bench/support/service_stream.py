"""The indexer-service benches' event stream and its sender (bench/bench_service.py, bench_apply.py,
bench_ingest.py): a deterministic per-worker stream of encoded KV event batches, and a PUB endpoint
per worker that writes pre-encoded ZMTP messages and answers replay requests itself.
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

import zmq

ROOT = Path(__file__).resolve().parents[2]

from producer.page_hash import page_ids  # noqa: E402
from schemas.codec import encode_batch  # noqa: E402
from schemas.events import BlockRemoved, BlockRemovedArr, BlockStored, BlockStoredArr, KVEventBatch  # noqa: E402
from bench.support.zmtp_pub import ZmtpPub, encode  # noqa: E402

BS = 16
SIZES = (1024, 8192, 32768)
# Event shapes on the wire: tagged maps (SGLang, vLLM 0.33) and vLLM's array-like tagged events
# (`["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]`), same content.
SHAPES = {"map": BlockStored, "array": BlockStoredArr}
REMOVES = {"map": BlockRemoved, "array": BlockRemovedArr}
# The streams' content (`Stream(..., kind=...)`): `shared` requests share 16 system prompts of 8
# blocks across the fleet; `unshared` requests are all the worker's own (6-26 blocks each) and every
# EVICT_EVERY-th request's blocks are removed EVICT_AFTER requests later (an LRU cache's evictions),
# so resident entries are ~88% of the blocks stored and most nodes have one holder.
KINDS = ("shared", "unshared")
EVICT_EVERY, EVICT_AFTER = 8, 4
# The hybrid stream (`Stream(..., hybrid=True)`): vLLM's group shape for a model with full-attention,
# sliding-window and Mamba layers, every block stored in the three groups in one batch (the
# window's W tokens and a state at every block: the usable prefix is the KV match, so both services'
# answers are checked against the same truth; Dynamo indexes the KV alone).
HYBRID_GROUPS = ((0, "full_attention", None), (1, "sliding_window", 4096), (2, "mamba", None))


def group_events(event: Any, hybrid: bool, **fields: Any) -> list[Any]:
    """One store, or (hybrid) the same store in each group of HYBRID_GROUPS."""
    if not hybrid:
        return [event(**fields)]
    return [event(**fields, group_idx=g, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=w)
            for g, kind, w in HYBRID_GROUPS]

# --- the workload -------------------------------------------------------------------------------

class Stream:
    """Per worker: a long document (for deep queries) stored in chunks, then many requests (`kind`
    shared: sharing system prompts; unshared: the worker's own, some evicted again); the last batch of
    each worker is a marker chain polled for visibility."""

    def __init__(self, workers: int, batches: int, seed: int = 0, shape: str = "map", hybrid: bool = False,
                 kind: str = "shared") -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown stream kind {kind!r}")
        rng = random.Random(seed)
        self.kind = kind
        self.event = SHAPES[shape]
        self.remove_event = REMOVES[shape]
        self.hybrid = hybrid
        self.ts = time.time()
        self.payloads: list[list[bytes]] = []
        self.docs: list[list[int]] = []
        self.markers: list[list[int]] = []
        self.blocks = 0
        self.requests: list[list[int]] = []  # a sample of request prompts (shared system prompts: many workers hit)
        self.stored: list[set[int]] = []  # per worker: every block id it holds at the end (the truth answers are checked against)
        self.removed = 0  # blocks removed again (unshared: evictions)
        prompts = [[rng.randrange(1, 100_000) for _ in range(BS * 8)] for _ in range(16)]
        for w in range(workers):
            out: list[bytes] = []
            doc = [rng.randrange(1, 100_000) for _ in range(max(SIZES))]
            self.docs.append(doc)
            out += self._chain(doc, 64)
            stored: set[int] = set(page_ids(doc, BS))
            chains: list[list[int]] = []
            for b in range(batches):
                if kind == "shared":
                    toks = rng.choice(prompts) + [rng.randrange(1, 100_000) for _ in range(BS * rng.randint(2, 12))]
                else:
                    toks = [rng.randrange(1, 100_000) for _ in range(BS * rng.randint(6, 26))]
                out += self._chain(toks, 1 << 30, stored)
                chains.append(page_ids(toks, BS))
                if b < 4:
                    self.requests.append(toks)
                if kind == "unshared" and b >= EVICT_AFTER and (b - EVICT_AFTER) % EVICT_EVERY == 0:
                    out.append(self._evict(chains[b - EVICT_AFTER], stored))
            marker = [rng.randrange(1, 100_000) for _ in range(BS * 4)]
            self.markers.append(marker)
            out += self._chain(marker, 1 << 30)
            stored.update(page_ids(marker, BS))
            self.stored.append(stored)
            self.payloads.append(out)

    @property
    def entries(self) -> int:
        """Resident (worker, block) entries once the stream is applied."""
        return sum(map(len, self.stored))

    def _evict(self, ids: list[int], stored: set[int]) -> bytes:
        """One batch removing a request's blocks, leaf first (the request's own: unshared ids)."""
        gone = [h for h in reversed(ids) if h in stored]
        stored.difference_update(gone)
        self.removed += len(gone)
        evs = ([self.remove_event(block_hashes=gone, medium="GPU", group_idx=g) for g, _, _ in HYBRID_GROUPS]
               if self.hybrid else [self.remove_event(block_hashes=gone, medium="GPU")])
        return encode_batch(KVEventBatch(self.ts, evs))

    def _chain(self, toks: list[int], per_batch: int, stored: set[int] | None = None) -> list[bytes]:
        ids = page_ids(toks, BS)
        first = 0
        if stored is not None:
            while first < len(ids) and ids[first] in stored:
                first += 1
            stored.update(ids)
        out = []
        for i in range(first, len(ids), per_batch):
            j = min(len(ids), i + per_batch)
            evs = group_events(self.event, self.hybrid, block_hashes=ids[i:j],
                               parent_block_hash=ids[i - 1] if i else None, token_ids=toks[i * BS: j * BS],
                               block_size=BS, medium="GPU")
            out.append(encode_batch(KVEventBatch(self.ts, evs)))
            self.blocks += j - i
        return out


# --- the sender (the same for both services) ---------------------------------------------------

END_SEQ = (-1).to_bytes(8, "big", signed=True)


# Replay replies a publisher sends per `serve_replay` call (see there).
REPLAY_CHUNK = 128


class RawPublisher:
    """One worker's wire: a PUB endpoint sending `[topic, seq, payload]` (design §2) from the caller's
    thread, and a replay ROUTER the bench serves between sends (`serve_replay`) so the probe phase's
    slow-joiner losses are recovered like a real publisher's. The PUB side is `zmtp_pub.ZmtpPub`:
    messages are ZMTP-encoded before the clock starts and a chunk of them is one `sendall` into a
    send buffer that holds the whole stream, so the sender costs next to nothing next to the service
    under test (a pyzmq PUB cost ~12 µs a message on this box and set the live figure). No queue,
    no thread; the same bytes for both services."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.pub = ZmtpPub()
        self.endpoint = self.pub.endpoint
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops replies past its HWM: a replay must not lose any
        self.replay_endpoint = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.sent: list[bytes] = []  # payload by seq (the replay buffer)
        self.replays: list[list[Any]] = []  # open replays: [requester identity, next seq to send]

    def frames(self, payloads: list[bytes]) -> list[bytes]:
        """Pre-encoded messages for `payloads`, numbered after what was sent so far."""
        base = len(self.sent)
        return [encode(b"", base + k, p) for k, p in enumerate(payloads)]

    def send(self, msg: bytes, payloads: list[bytes] | None = None) -> None:
        """Pre-encoded message(s) (`frames`); `payloads`: what they carry (one message: parsed back)."""
        self.pub.send(msg)
        self.sent.extend(payloads if payloads is not None else [_payload_of(msg)])

    def serve_replay(self, max_replies: int = REPLAY_CHUNK) -> None:
        """Take new replay requests, then send at most `max_replies` replies of the open ones. Bounded,
        because the bench serves every publisher from one thread: answering a whole history at once
        kept the later publishers silent past the subscriber's replay timeout (2 s) while the earlier
        ones were served, and those replays were given up."""
        self.pub.accept()
        while self.router.poll(0):
            req = self.router.recv_multipart()
            start = int.from_bytes(req[2], "big") if len(req) == 3 and len(req[2]) == 8 else len(self.sent)
            self.replays.append([req[0], start])
        budget = max_replies
        while self.replays and budget > 0:
            ident, seq = self.replays[0]
            end = min(len(self.sent), seq + budget)
            for s in range(seq, end):
                self.router.send_multipart([ident, b"", b"", s.to_bytes(8, "big"), self.sent[s]])
            budget -= end - seq
            if end < len(self.sent):
                self.replays[0][1] = end
            else:
                self.router.send_multipart([ident, b"", b"", END_SEQ, b""])
                self.replays.pop(0)

    def close(self) -> None:
        self.pub.close()
        self.router.close(0)


def _payload_of(msg: bytes) -> bytes:
    """The payload frame of one encoded `[topic, seq, payload]` message (topic b"": 2 + 10 bytes)."""
    head = 12
    return msg[head + 9:] if msg[head] & 0x02 else msg[head + 2:]


# Messages per write when sending a stream: about 4-16 KB per sendall, worker after worker.
CHUNK = 32


def send_interleaved(pubs: list[RawPublisher], payloads: list[list[bytes]]) -> None:
    """Send every worker's stream, interleaved the way a fleet would send: CHUNK messages of one
    worker, then the next worker's, round the fleet (each write one sendall of pre-encoded bytes)."""
    plan = chunked(pubs, payloads)
    send_chunks(plan)


def chunked(pubs: list[RawPublisher], payloads: list[list[bytes]]) -> list[tuple[RawPublisher, bytes, list[bytes]]]:
    """The writes of `send_interleaved`, encoded (done before a clock starts)."""
    per = []
    for p, pl in zip(pubs, payloads):
        msgs = p.frames(pl)
        per.append([(p, b"".join(msgs[i:i + CHUNK]), pl[i:i + CHUNK]) for i in range(0, len(msgs), CHUNK)])
    out = []
    for k in range(max(len(c) for c in per)):
        for c in per:
            if k < len(c):
                out.append(c[k])
    return out


def send_chunks(plan: list[tuple[RawPublisher, bytes, list[bytes]]]) -> None:
    for p, data, pl in plan:
        p.send(data, pl)
