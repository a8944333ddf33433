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
from schemas.events import BlockStored, BlockStoredArr, KVEventBatch  # noqa: E402
from bench.support.zmtp_pub import ZmtpPub, encode  # noqa: E402

BS = 16
SIZES = (1024, 8192, 32768)
# Event shapes on the wire: tagged maps (SGLang, vLLM 0.33) and vLLM's array-like tagged events
# (`["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]`), same content.
SHAPES = {"map": BlockStored, "array": BlockStoredArr}

# --- the workload -------------------------------------------------------------------------------

class Stream:
    """Per worker: a long document (for deep queries) stored in chunks, then many requests that
    share system prompts; the last batch of each worker is a marker chain polled for visibility."""

    def __init__(self, workers: int, batches: int, seed: int = 0, shape: str = "map") -> None:
        rng = random.Random(seed)
        self.event = SHAPES[shape]
        self.ts = time.time()
        self.payloads: list[list[bytes]] = []
        self.docs: list[list[int]] = []
        self.markers: list[list[int]] = []
        self.blocks = 0
        self.requests: list[list[int]] = []  # a sample of request prompts (shared system prompts: many workers hit)
        self.stored: list[set[int]] = []  # per worker: every block id it stored (the truth answers are checked against)
        prompts = [[rng.randrange(1, 100_000) for _ in range(BS * 8)] for _ in range(16)]
        for w in range(workers):
            out: list[bytes] = []
            doc = [rng.randrange(1, 100_000) for _ in range(max(SIZES))]
            self.docs.append(doc)
            out += self._chain(doc, 64)
            stored: set[int] = set(page_ids(doc, BS))
            for b in range(batches):
                toks = rng.choice(prompts) + [rng.randrange(1, 100_000) for _ in range(BS * rng.randint(2, 12))]
                out += self._chain(toks, 1 << 30, stored)
                if b < 4:
                    self.requests.append(toks)
            marker = [rng.randrange(1, 100_000) for _ in range(BS * 4)]
            self.markers.append(marker)
            out += self._chain(marker, 1 << 30)
            stored.update(page_ids(marker, BS))
            self.stored.append(stored)
            self.payloads.append(out)

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
            ev = self.event(block_hashes=ids[i:j], parent_block_hash=ids[i - 1] if i else None,
                            token_ids=toks[i * BS: j * BS], block_size=BS, medium="GPU")
            out.append(encode_batch(KVEventBatch(self.ts, [ev])))
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
