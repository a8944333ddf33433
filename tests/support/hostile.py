"""A hostile worker for replay hardening tests: a PUB that skips seqs, and a replay ROUTER that
trickles garbage (never an end marker) or floods large replies inside the gap
(test_service_hardening, soak/test_soak)."""
from __future__ import annotations

import threading
import time

import msgspec
import zmq

from schemas.frames import seq_bytes

class HostilePublisher:
    """A PUB that skips seqs, and a replay ROUTER that trickles garbage (never an end marker)
    or streams large replies inside the gap, forever."""

    def __init__(self, mode: str) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.rep = self.ctx.socket(zmq.ROUTER)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.rep.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.replay_endpoint = f"tcp://127.0.0.1:{self.rep.bind_to_random_port('tcp://127.0.0.1')}"
        self.mode = mode
        self.requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def send(self, seq: int) -> None:
        self.pub.send_multipart([b"", seq_bytes(seq), msgspec.msgpack.encode([time.time(), [], 0])])

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.rep, zmq.POLLIN)
        peers: list[bytes] = []
        n = 0
        while not self._stop.is_set():
            if poller.poll(20):
                frames = self.rep.recv_multipart()
                peers.append(frames[0])
                self.requests += 1
            for peer in peers:
                n += 1
                try:
                    if self.mode == "trickle":
                        self.rep.send_multipart([peer, b"", b"garbage"], zmq.NOBLOCK)
                    else:  # big replies inside the gap, never reaching its end
                        self.rep.send_multipart([peer, b"", b"", seq_bytes(1), b"x" * 512 * 1024], zmq.NOBLOCK)
                except zmq.Again:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pub.close(0)
        self.rep.close(0)
        self.ctx.term()
