"""Capacity of the JetStream event plane against the ZeroMQ path, same synthetic fleet, same run.

    .venv/bin/python -m bench.bench_jetstream --quick
    .venv/bin/python -m bench.bench_jetstream --workers 1000 --batches 40 --rate 5000

A lean sender publishes pre-encoded batches of a simulated fleet (W workers). Replicas are
processes running the real consumer (JetStreamSubscriber or the ZeroMQ Subscriber) plus a KVIndex
applying every payload. Figures (docs/scaling.md reads them):

1. capacity: the whole backlog (W x B batches) already in the stream, 1 and 2 replicas drain it;
   per-replica batches/s and blocks/s (ZeroMQ: same batches, sender and consumer concurrent).
2. latency: live publishing at `--rate` batches/s for `--seconds`; publish -> applied p50/p99.
3. nats-server CPU seconds and RSS over each phase.
Ratios are JetStream / ZeroMQ measured here; nothing is compared with a number from elsewhere.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


import msgspec  # noqa: E402

from schemas.events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from schemas.jetstream import (  # noqa: E402
    HDR_EPOCH, HDR_MSG_ID, HDR_SEQ, StreamSettings, event_subject, jetstream_endpoint, msg_id, subject_token,
)

BS = 16
MODEL = "bench"
_enc = msgspec.msgpack.Encoder()


def fleet_payloads(workers: int, batches: int, seed: int = 1) -> tuple[list[list[bytes]], int]:
    """Per worker, `batches` payloads: chains of 4 blocks stored, sometimes a removal. Returns
    (payloads, blocks stored in total)."""
    rng = random.Random(seed)
    out: list[list[bytes]] = []
    blocks = 0
    for w in range(workers):
        seqs: list[bytes] = []
        live: list[int] = []
        for b in range(batches):
            if live and rng.random() < 0.2:
                h = live.pop(rng.randrange(len(live)))
                ev = [BlockRemoved(block_hashes=[h], medium="GPU")]
            else:
                base = (w << 32) | (b << 8)
                hs = [base + i for i in range(4)]
                toks = [rng.randrange(1, 50_000) for _ in range(4 * BS)]
                ev = [BlockStored(block_hashes=hs, parent_block_hash=None, token_ids=toks, block_size=BS,
                                  lora_id=None, medium="GPU")]
                live.extend(hs)
                blocks += 4
            seqs.append(_enc.encode(KVEventBatch(0.0, ev)))
        out.append(seqs)
    return out, blocks


def restamp(payload: bytes) -> bytes:
    """The same batch with ts = now (latency is measured from it)."""
    b = msgspec.msgpack.decode(payload, type=KVEventBatch)
    return _enc.encode(KVEventBatch(time.time(), b.events, b.data_parallel_rank))


# --- nats-server --------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self) -> None:
        binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
        self.dir = tempfile.mkdtemp(prefix="kvatlas-bench-nats-")
        self.port = free_port()
        self.proc = subprocess.Popen([binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", self.dir],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    if s.recv(4) == b"INFO":
                        return
            except OSError:
                time.sleep(0.02)  # waiting for an external process to listen
        raise RuntimeError("nats-server did not start")

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def cpu_s(self) -> float:
        parts = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


# --- replicas (child processes) -----------------------------------------------------------------

def _apply(index, deliveries: list, lags: list[float]) -> tuple[int, int]:  # noqa: ANN001
    """Apply the batches among `deliveries`, each one's publish-to-apply lag into `lags`:
    (batches applied, blocks stored)."""
    from indexer.deliveries import Batch

    applied = blocks = 0
    for d in deliveries:
        if isinstance(d, Batch):
            st = index.apply_payload(MODEL, d.worker_id, 0, d.payload, rank_from_batch=True)
            applied += 1
            if st.ts > 0:
                lags.append(time.time() - st.ts)
            blocks += sum(n for (t, _m, _o), n in st.counts.items() if t == "stored")
    return applied, blocks


def _replica(kind: str, target: str, endpoints: list[tuple[str, str]], expect: int, ready, conn) -> None:  # noqa: ANN001
    import logging
    logging.disable(logging.WARNING)  # the live phase's epoch changes are expected
    from indexer.index import KVIndex

    index = KVIndex()
    index.ensure_model(MODEL, BS)
    if kind == "js":
        from indexer.jetstream_subscriber import JetStreamSubscriber
        sub = JetStreamSubscriber(target, stream=StreamSettings(name="BENCH"), ensure=False,
                                  shared=os.environ.get("KVATLAS_BENCH_SHARED") == "1")
    else:
        from indexer.subscriber import Subscriber
        sub = Subscriber()
    t0 = time.perf_counter()
    for wid, ep in endpoints:
        sub.add(wid, ep)
    add_s = time.perf_counter() - t0
    ready.set()
    lags: list[float] = []
    applied = blocks = 0
    start = None
    idle_since = time.monotonic()
    while applied < expect:
        ds = sub.poll(200)
        if not ds:
            if start is not None and time.monotonic() - idle_since > 5.0:
                break  # batches lost (ZeroMQ slow joiner): report what arrived
            continue
        idle_since = time.monotonic()
        if start is None:
            start = time.perf_counter()
        n, stored = _apply(index, ds, lags)
        applied += n
        blocks += stored
    end = time.perf_counter()
    # JetStream: the backlog starts flowing while workers are still being added, so the drain is
    # timed from the first add (subscribe cost included); ZeroMQ: from the first delivery.
    elapsed = end - (t0 if kind == "js" else (start or end))
    sub.close()
    conn.send({"applied": applied, "blocks": blocks, "elapsed": elapsed, "add_s": add_s, "lags": lags})


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


def _run(n: int, target: object, args: tuple, send=None) -> list[dict]:  # noqa: ANN001
    """`n` replica processes of `target(*args, ready, conn)`; once every one is ready, `send()`, then
    each one's result."""
    ctx = mp.get_context("spawn")
    procs, pipes, readies = [], [], []
    for _ in range(n):
        a, b = ctx.Pipe()
        ready = ctx.Event()
        p = ctx.Process(target=target, args=(*args, ready, b))
        p.start()
        procs.append(p)
        pipes.append(a)
        readies.append(ready)
    for r in readies:
        r.wait(600)
    if send is not None:
        send()
    out = [c.recv() for c in pipes]
    for p in procs:
        p.join(30)
    return out


def run_replicas(kind: str, n: int, target: str, endpoints: list[tuple[str, str]], expect: int,
                 send=None) -> list[dict]:  # noqa: ANN001
    return _run(n, _replica, (kind, target, endpoints, expect), send)


# --- senders ------------------------------------------------------------------------------------

def js_send(url: str, payloads: list[list[bytes]], rate: float | None, stamp: bool, epoch: str = "e1") -> float:
    """Publish every batch (round-robin over workers) with core NATS publishes into the stream."""
    from transport.natsio import NatsThread

    nt = NatsThread(url, name="bench-sender")
    subjects = [event_subject(MODEL, f"w{i}") for i in range(len(payloads))]
    tokens = [subject_token(f"w{i}") for i in range(len(payloads))]

    async def go() -> float:
        nc = nt.nc
        t0 = time.perf_counter()
        sent = 0
        for b in range(len(payloads[0])):
            for w, seqs in enumerate(payloads):
                p = restamp(seqs[b]) if stamp else seqs[b]
                await nc.publish(subjects[w], p, headers={HDR_SEQ: str(b), HDR_EPOCH: epoch,
                                                          HDR_MSG_ID: msg_id(tokens[w], epoch, b)})
                sent += 1
                if rate is not None:
                    due = t0 + sent / rate
                    delay = due - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)  # pacing the offered load
        await nc.flush(timeout=60)
        return time.perf_counter() - t0

    try:
        return nt.call(go, timeout=3600)
    finally:
        nt.close()


def wait_stored(url: str, total: int) -> None:
    from transport.natsio import NatsThread

    nt = NatsThread(url, name="bench-probe")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            info = nt.call(lambda: nt.js.stream_info("BENCH"))
            if info.state.messages >= total:
                return
            time.sleep(0.05)  # polling the server's count
        raise RuntimeError("stream did not reach the expected message count")
    finally:
        nt.close()


def zmq_fleet(workers: int):  # noqa: ANN201
    import zmq
    ctx = zmq.Context()
    socks, eps = [], []
    for i in range(workers):
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.SNDHWM, 0)
        s.bind("tcp://127.0.0.1:*")
        socks.append(s)
        eps.append((f"w{i}", s.getsockopt_string(zmq.LAST_ENDPOINT)))
    return ctx, socks, eps


def zmq_send(socks: list, payloads: list[list[bytes]], rate: float | None, stamp: bool) -> None:  # noqa: ANN001
    t0 = time.perf_counter()
    sent = 0
    for b in range(len(payloads[0])):
        seq = b.to_bytes(8, "big")
        for w, seqs in enumerate(payloads):
            socks[w].send_multipart([b"", seq, restamp(seqs[b]) if stamp else seqs[b]])
            sent += 1
            if rate is not None:
                delay = t0 + sent / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)  # pacing the offered load


# --- main ---------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small fleet, a few seconds per phase")
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--batches", type=int, default=40, help="backlog batches per worker (capacity phase)")
    ap.add_argument("--rate", type=float, default=3000.0, help="live batches/s over the fleet (latency phase)")
    ap.add_argument("--seconds", type=float, default=5.0, help="latency phase length")
    ap.add_argument("--shared", action="store_true",
                    help="JetStream replicas use one shared consumer instead of one per worker")
    args = ap.parse_args()
    if args.shared:
        os.environ["KVATLAS_BENCH_SHARED"] = "1"  # read by the spawned replica processes
    print(f"jetstream consumers: {'one shared per replica' if args.shared else 'one per worker'}")
    if args.quick:
        args.workers, args.batches, args.rate, args.seconds = 200, 20, 2000.0, 2.0
    W, B = args.workers, args.batches
    payloads, blocks = fleet_payloads(W, B)
    total = W * B
    print(f"fleet: {W} workers x {B} batches = {total} batches, {blocks} blocks stored; "
          f"{sum(len(p) for s in payloads for p in s) / total:.0f} B/batch")
    rows: dict[str, dict] = {}

    srv = Server()
    try:
        from transport.natsio import NatsThread, ensure_stream
        nt = NatsThread(srv.url)
        nt.call(lambda: ensure_stream(nt.js, StreamSettings(name="BENCH", duplicate_window_s=120.0)))
        nt.close()
        js_eps = [(f"w{i}", jetstream_endpoint(MODEL, f"w{i}")) for i in range(W)]
        cpu0 = srv.cpu_s()
        send_s = js_send(srv.url, payloads, None, False)
        wait_stored(srv.url, total)
        print(f"jetstream sender: {total / send_s:,.0f} batches/s into the stream "
              f"(nats-server {srv.cpu_s() - cpu0:.2f} CPU s, RSS {srv.rss_mb():.0f} MB)")
        for n in (1, 2):
            cpu0 = srv.cpu_s()
            res = run_replicas("js", n, srv.url, js_eps, total)
            cpu = srv.cpu_s() - cpu0
            bps = [r["applied"] / r["elapsed"] for r in res]
            rows[f"js_cap_{n}"] = {"bps": min(bps), "blocks": min(r["blocks"] / r["elapsed"] for r in res),
                                   "add_s": max(r["add_s"] for r in res), "cpu": cpu, "rss": srv.rss_mb()}
            print(f"jetstream capacity, {n} replica(s): {min(bps):,.0f} batches/s per replica "
                  f"({rows[f'js_cap_{n}']['blocks']:,.0f} blocks/s, timed from the first subscribe), subscribe {W} workers "
                  f"{rows[f'js_cap_{n}']['add_s']:.1f}s, nats-server {cpu:.2f} CPU s, RSS {srv.rss_mb():.0f} MB")
        live = int(args.rate * args.seconds)
        live_payloads = [p[: max(1, live // W)] for p in payloads]
        live_total = W * len(live_payloads[0])
        # Live traffic goes on after the backlog: replicas start at the stream's end.
        for n in (1, 2):
            with_ts = live_payloads
            start_mark = None

            def send() -> None:
                js_send(srv.url, with_ts, args.rate, True, f"live{n}")

            from transport.natsio import NatsThread as _NT
            probe = _NT(srv.url)
            start_mark = probe.call(lambda: probe.js.stream_info("BENCH")).state.last_seq
            probe.close()
            eps = [(w, ep) for w, ep in js_eps]
            cpu0 = srv.cpu_s()
            res = run_replicas_from("js", n, srv.url, eps, live_total, start_mark, send)
            lags = [x for r in res for x in r["lags"]]
            rows[f"js_lat_{n}"] = {"p50": _pct(lags, 0.5), "p99": _pct(lags, 0.99), "cpu": srv.cpu_s() - cpu0}
            print(f"jetstream latency, {n} replica(s) at {args.rate:,.0f} batches/s: p50 "
                  f"{rows[f'js_lat_{n}']['p50'] * 1e3:.1f} ms, p99 {rows[f'js_lat_{n}']['p99'] * 1e3:.1f} ms, "
                  f"nats-server {rows[f'js_lat_{n}']['cpu']:.2f} CPU s over {live_total} batches")
    finally:
        srv.close()

    ctx, socks, zeps = zmq_fleet(W)
    try:
        for n in (1, 2):
            res = run_replicas("zmq", n, "", zeps, total,
                               send=lambda: (time.sleep(1.0), zmq_send(socks, payloads, None, False)))
            bps = [r["applied"] / r["elapsed"] for r in res]
            if any(r["applied"] < total for r in res):
                print(f"  (zeromq lost {total - min(r['applied'] for r in res)} batches to the slow joiner)")
            rows[f"zmq_cap_{n}"] = {"bps": min(bps), "blocks": min(r["blocks"] / r["elapsed"] for r in res)}
            print(f"zeromq capacity, {n} replica(s): {min(bps):,.0f} batches/s per replica "
                  f"({rows[f'zmq_cap_{n}']['blocks']:,.0f} blocks/s)")
        for n in (1, 2):
            res = run_replicas("zmq", n, "", zeps, live_total,
                               send=lambda: (time.sleep(1.0), zmq_send(socks, live_payloads, args.rate, True)))
            lags = [x for r in res for x in r["lags"]]
            rows[f"zmq_lat_{n}"] = {"p50": _pct(lags, 0.5), "p99": _pct(lags, 0.99)}
            print(f"zeromq latency, {n} replica(s): p50 {rows[f'zmq_lat_{n}']['p50'] * 1e3:.1f} ms, "
                  f"p99 {rows[f'zmq_lat_{n}']['p99'] * 1e3:.1f} ms")
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
    for n in (1, 2):
        print(f"ratio jetstream/zeromq, {n} replica(s): capacity "
              f"{rows[f'js_cap_{n}']['bps'] / rows[f'zmq_cap_{n}']['bps']:.2f}x, latency p50 "
              f"{rows[f'js_lat_{n}']['p50'] / rows[f'zmq_lat_{n}']['p50']:.2f}x, p99 "
              f"{rows[f'js_lat_{n}']['p99'] / rows[f'zmq_lat_{n}']['p99']:.2f}x")
    return 0


def _replica_from(target: str, endpoints: list[tuple[str, str]], expect: int, start: int, ready, conn) -> None:  # noqa: ANN001
    """A JetStream replica that starts at stream seq `start` (the live phase)."""
    import logging
    logging.disable(logging.WARNING)  # every worker's first live batch is a new epoch: expected
    from indexer.index import KVIndex
    from indexer.jetstream_subscriber import JetStreamSubscriber

    index = KVIndex()
    index.ensure_model(MODEL, BS)
    sub = JetStreamSubscriber(target, stream=StreamSettings(name="BENCH"), ensure=False,
                              shared=os.environ.get("KVATLAS_BENCH_SHARED") == "1")
    for wid, ep in endpoints:
        sub.add(wid, ep, last_seq=start)
    ready.set()
    lags: list[float] = []
    applied = 0
    idle_since = time.monotonic()
    while applied < expect and time.monotonic() - idle_since < 30.0:
        ds = sub.poll(200)
        if ds:
            idle_since = time.monotonic()
        applied += _apply(index, ds, lags)[0]
    sub.close()
    conn.send({"applied": applied, "lags": lags})


def run_replicas_from(kind: str, n: int, target: str, endpoints: list[tuple[str, str]], expect: int,
                      start: int, send) -> list[dict]:  # noqa: ANN001
    return _run(n, _replica_from, (target, endpoints, expect, start), send)


if __name__ == "__main__":
    sys.exit(main())
