"""Over real ZeroMQ sockets: a live message that arrives late (after the message that followed it,
whose gap replay already delivered it) is dropped as a copy; a different payload at a passed seq
is a restart whose rebuild brings back every batch the live stream had passed (docs/service.md,
"Replays": stale live messages). The pure rules are tested in test_sequencing_stale.py."""
from __future__ import annotations

import threading
import time

import msgspec
import zmq

from indexer.deliveries import Batch, Delivery, Gap, Restart
from indexer.subscriber import Subscriber
from schemas.frames import END_SEQ

LOOP = "tcp://127.0.0.1:*"


def test_late_live_copy_keeps_the_batches_after_it(zmq_ctx: zmq.Context) -> None:
    pub = zmq_ctx.socket(zmq.PUB)
    pub.bind(LOOP)
    router = zmq_ctx.socket(zmq.ROUTER)
    router.bind(LOOP)
    sent: dict[int, bytes] = {}  # the publisher's replay buffer
    lock = threading.Lock()
    stop = threading.Event()

    def serve() -> None:  # replays from the asked seq to the newest, then the end marker
        while not stop.is_set():
            if not router.poll(20):
                continue
            ident, _, start_b = router.recv_multipart()
            start = int.from_bytes(start_b, "big")
            with lock:
                items = sorted((s, p) for s, p in sent.items() if s >= start)
            for s, p in items:
                router.send_multipart([ident, b"", b"", s.to_bytes(8, "big"), p])
            router.send_multipart([ident, b"", b"", END_SEQ, b""])

    def publish(seq: int, wire: bool = True) -> None:
        payload = msgspec.msgpack.encode([time.time(), [], 0])
        with lock:
            sent[seq] = payload
        if wire:
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    server = threading.Thread(target=serve)
    server.start()
    sub = Subscriber(zmq_ctx, replay_timeout=2.0)
    applied: set[int] = set()
    out: list[Delivery] = []

    def poll_until(done, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"timed out: {out[-5:]}"
            for d in sub.poll(20):
                out.append(d)
                if isinstance(d, Restart) or (isinstance(d, Gap) and not d.recovered):
                    applied.clear()  # what the index does: clear the worker
                elif isinstance(d, Batch):
                    applied.add(d.seq)

    try:
        sub.add("w", pub.getsockopt_string(zmq.LAST_ENDPOINT), router.getsockopt_string(zmq.LAST_ENDPOINT))
        seqs = iter(range(1000))
        last = [0]

        def joined() -> bool:  # PUB/SUB join is asynchronous: publish until one arrives live
            if any(isinstance(d, Batch) and not d.replayed for d in out):
                return True
            last[0] = next(seqs)
            publish(last[0])
            return False

        poll_until(joined)
        n = last[0]
        publish(n + 1, wire=False)  # held back on the way ...
        publish(n + 2)  # ... so this one reveals a gap, filled by the replay
        poll_until(lambda: sub.watermark("w") == n + 2 and not sub.replaying())
        dups = sub.stats.duplicates
        pub.send_multipart([b"", (n + 1).to_bytes(8, "big"), sent[n + 1]])  # ... then arrives late
        poll_until(lambda: sub.stats.duplicates > dups)
        # A copy of a delivered batch: dropped, nothing cleared, nothing replayed.
        assert not any(isinstance(d, Restart) for d in out) and not sub.replaying()
        assert applied == set(range(n + 3)) and sub.watermark("w") == n + 2

        # A different payload at a passed seq reads as a restart: cleared, rebuilt from the replay,
        # and the catch-up brings back n+2, which the live stream will not send again.
        other = msgspec.msgpack.encode([time.time() + 1.0, [], 7])
        pub.send_multipart([b"", (n + 1).to_bytes(8, "big"), other])
        poll_until(lambda: any(isinstance(d, Restart) for d in out) and not sub.replaying())
        assert applied == set(range(n + 3))
        assert sub.watermark("w") == n + 2
        publish(n + 3)  # the live stream goes on, in order, with nothing delivered twice
        poll_until(lambda: sub.watermark("w") == n + 3)
        assert applied == set(range(n + 4))
    finally:
        stop.set()
        server.join()
        sub.close()
