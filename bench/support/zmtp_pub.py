"""A bench-only ZeroMQ PUB peer that speaks ZMTP 3.0 (NULL mechanism) itself over a plain TCP socket.

Why: a pyzmq PUB costs the sending thread a few µs per message and its I/O thread encodes every frame
again, so on a 2-core box the sender — not the service under test — set the "live" ingest figure
(docs/benchmarks.md). Here every message is encoded once, before the clock starts, and a run of them
goes to the kernel in one `sendall`; with a send buffer large enough for the whole stream, sending
costs the bench almost nothing and never waits for a stopped service. Both services under test get
the same bytes: what they receive is a standard ZeroMQ PUB stream (libzmq SUBs read it as such;
`tests` are not involved — this file is a measuring tool).

ZMTP 3.0 (rfc.zeromq.org/spec/23): a 64-byte greeting each way, a READY command each way, then
frames `flags size body` (flags: 0x01 MORE, 0x02 LONG size, 0x04 COMMAND). What the SUB sends
after READY (its subscription) is not needed — a PUB may send every message — and is never read.
"""
from __future__ import annotations

import socket

GREETING = (b"\xff" + b"\x00" * 7 + b"\x01" + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00")
            + b"\x00" + b"\x00" * 31)
assert len(GREETING) == 64


def _command(name: bytes, props: dict[bytes, bytes]) -> bytes:
    body = bytes([len(name)]) + name
    for k, v in props.items():
        body += bytes([len(k)]) + k + len(v).to_bytes(4, "big") + v
    assert len(body) < 256
    return b"\x04" + bytes([len(body)]) + body


READY_PUB = _command(b"READY", {b"Socket-Type": b"PUB"})


def frame(body: bytes, more: bool) -> bytes:
    flags = 0x01 if more else 0x00
    n = len(body)
    if n < 256:
        return bytes([flags, n]) + body
    return bytes([flags | 0x02]) + n.to_bytes(8, "big") + body


def encode(topic: bytes, seq: int, payload: bytes) -> bytes:
    """One `[topic, seq, payload]` message (design §2) as ZMTP frames."""
    return frame(topic, True) + frame(seq.to_bytes(8, "big"), True) + frame(payload, False)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("peer closed during the ZMTP handshake")
        out += chunk
    return out


class ZmtpPub:
    """PUB endpoint `tcp://127.0.0.1:port`: accepts SUB connections (handshaking each), and writes
    pre-encoded messages to every connected subscriber. No thread: `accept()` is called by the
    sender's own loop (a SUB that connects later gets what is sent after it joined, as with PUB)."""

    SNDBUF = 4 << 20  # the kernel doubles it; a whole bench stream per worker fits

    def __init__(self) -> None:
        self.lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(16)
        self.lsock.setblocking(False)
        self.endpoint = f"tcp://127.0.0.1:{self.lsock.getsockname()[1]}"
        self.conns: list[socket.socket] = []

    def accept(self) -> None:
        """Take and handshake every pending connection (each handshake takes one round trip)."""
        while True:
            try:
                c, _ = self.lsock.accept()
            except BlockingIOError:
                return
            try:
                c.setblocking(True)
                c.settimeout(5.0)
                c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.SNDBUF)
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                c.sendall(GREETING)
                peer = _recv_exact(c, 64)
                if peer[0] != 0xFF or peer[9] != 0x7F or peer[10] < 3:
                    raise ConnectionError(f"not a ZMTP 3 peer: {peer[:12]!r}")
                c.sendall(READY_PUB)
                flags = _recv_exact(c, 1)[0]
                size = int.from_bytes(_recv_exact(c, 8 if flags & 0x02 else 1), "big")
                _recv_exact(c, size)  # the peer's READY (its socket type; a SUB here)
                c.settimeout(60.0)  # a full send buffer waits for the reader (never in practice)
            except (OSError, ConnectionError):
                c.close()
                continue
            self.conns.append(c)

    def send(self, data: bytes | memoryview) -> None:
        """Pre-encoded messages to every subscriber; a subscriber that went away is dropped."""
        self.accept()
        for c in list(self.conns):
            try:
                c.sendall(data)
            except OSError:
                c.close()
                self.conns.remove(c)

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.conns = []
        self.lsock.close()
