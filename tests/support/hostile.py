"""Hostile parties for the hardening tests and soaks: a worker whose PUB skips seqs and whose replay
ROUTER trickles garbage (never an end marker) or floods large replies inside the gap
(test_service_hardening, soak/test_soak); the hybrid group flood (issue 24 item 7), slowloris
sockets, and the probes the hostile soaks measure with (soak/test_soak_hostile_*.py)."""
from __future__ import annotations

import json
import random
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import msgspec
import zmq

from router_api.procs import spawn
from schemas.events import BlockStored, KVEventBatch
from schemas.frames import seq_bytes
from support.net import wait_until


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


# --- the hostile soaks' parts (tests/soak/test_soak_hostile_*.py) ------------------------------------

FLOOD_BS = 16
FLOOD_GROUPS = 10_000   # single-block sliding-window groups (the indexer keeps GROUP_CAP of them)
FLOOD_BLOCKS = 30_000   # the flood worker's chain: one /score of it is 480k tokens


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


class GroupFlood:
    """Issue 24 item 7's publisher: a 30,000-block full-attention chain, then stores into 10,000
    distinct sliding-window groups (one block each), cycled for as long as the soak runs."""

    def __init__(self, seed: int, chain_batch: int = 3_000, group_batch: int = 1_000) -> None:
        rng = random.Random(seed)
        bs = FLOOD_BS
        self.tokens = [rng.randrange(1, 50_000) for _ in range(FLOOD_BLOCKS * bs)]
        self.hashes = rng.sample(range(1, 1 << 62), FLOOD_BLOCKS)
        self.chain_batch = chain_batch
        self.group_batch = group_batch
        self._g = 0
        self.batches = 0  # group batches handed out
        self.score_body = json.dumps({"model": "hyb", "token_ids": self.tokens}).encode()

    def chain(self) -> Iterator[list]:
        bs, hs = FLOOD_BS, self.hashes
        for a in range(0, FLOOD_BLOCKS, self.chain_batch):
            b = min(a + self.chain_batch, FLOOD_BLOCKS)
            yield [BlockStored(hs[a:b], hs[a - 1] if a else None, self.tokens[a * bs:b * bs], bs, None, "GPU")]

    def groups(self) -> list:
        """The next `group_batch` group stores (groups 1..FLOOD_GROUPS, round robin)."""
        bs, hs, out = FLOOD_BS, self.hashes, []
        self.batches += 1
        for _ in range(self.group_batch):
            g = self._g % FLOOD_GROUPS + 1
            self._g += 1
            j = (g * 3) % FLOOD_BLOCKS
            out.append(BlockStored([hs[j]], hs[j - 1] if j else None, self.tokens[j * bs:(j + 1) * bs], bs, None,
                                   "GPU", group_idx=g, kv_cache_spec_kind="sliding_window",
                                   kv_cache_spec_sliding_window=32))
        return out


def group_limit_drops(metrics: str) -> float:
    """The indexer's `group_limit` drop count from its /metrics text."""
    m = re.search(r'^kvatlas_drops_total\{reason="group_limit"\} (\S+)$', metrics, re.M)
    return float(m.group(1)) if m else 0.0


def honest_hybrid(seed: int, blocks: int = 64) -> tuple[list, list[int]]:
    """An honest hybrid worker's events (its main tree and one sliding-window group holding every block
    of one prompt) and that prompt: its row must read device = cached = kv = `blocks`."""
    rng = random.Random(seed)
    bs = FLOOD_BS
    toks = [rng.randrange(1, 50_000) for _ in range(blocks * bs)]
    hs = rng.sample(range(1, 1 << 62), blocks)
    return ([BlockStored(hs, None, toks, bs, None, "GPU"),
             BlockStored(hs, None, toks, bs, None, "GPU", group_idx=1, kv_cache_spec_kind="sliding_window",
                         kv_cache_spec_sliding_window=64)], toks)


# The probe process (shared with bench/bench_health_under_load.py): GET /health every 20 ms.
_ROOT = Path(__file__).resolve().parents[2]


class HealthProbe:
    """GET /health every 20 ms from a process of its own (the test's threads and GIL do not add to
    the latencies), until `stop()`; every answer must be 200. Latencies in ms."""

    def __init__(self, url: str) -> None:
        self.ms: list[float] = []
        self.errors: list[str] = []
        self._proc: subprocess.Popen | None = spawn(
            [sys.executable, "-m", "bench.support.health_probe", url, "20"], cwd=_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def stop(self) -> None:
        if self._proc is None:
            return
        out, _ = self._proc.communicate("", timeout=60)  # closing its stdin ends the probe
        self._proc = None
        got = json.loads(out)
        self.ms, self.errors = got["ms"], got["errors"]

    def summary(self) -> tuple[int, float, float]:
        """(samples, p50, p99) in ms."""
        ms = self.ms
        assert ms, "no /health sample"
        p99 = statistics.quantiles(ms, n=100)[98] if len(ms) >= 100 else max(ms)
        return len(ms), statistics.median(ms), p99


class LargeScores:
    """POST a pre-encoded /score body in a loop in a thread (the 480k-token hybrid query)."""

    def __init__(self, url: str, body: bytes) -> None:
        self.url = url
        self.body = body
        self.answers: list[dict] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="large-scores")
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120.0) as c:
            while not self._stop.is_set():
                try:
                    r = c.post("/score", content=self.body, headers={"content-type": "application/json"})
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    continue
                if r.status_code != 200:
                    self.errors.append(f"{r.status_code} {r.text[:200]}")
                else:
                    self.answers.append(r.json())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)

    def last(self) -> dict:
        """One more answer, after quiescence (the thread stopped)."""
        with httpx.Client(base_url=self.url, timeout=120.0) as c:
            r = c.post("/score", content=self.body, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text[:300]
        return r.json()


def slowloris(port: int, n: int) -> list[socket.socket]:
    """n connections that send partial headers and never finish them."""
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /workers HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n")
        out.append(s)
    return out


def closed_by_server(socks: list[socket.socket]) -> None:
    """Each slowloris socket is answered (408) and closed by the server: read to EOF."""
    for s in socks:
        s.settimeout(30)
        while s.recv(4096):
            pass


def check_hybrid_beside_flood(client: httpx.Client, hh_prompt: list[int], scorer: LargeScores) -> None:
    """The honest hybrid worker `hh` reads its whole prompt beside the group flood, and the flood's
    480k-token scores read its own chain only: neither worker's events touched the other's rows."""
    hyb = {x["worker_id"]: x for x in client.post("/score", json={"model": "hyb", "token_ids": hh_prompt})
           .json()["workers"]}
    n_hh = len(hh_prompt) // FLOOD_BS
    assert (hyb["hh"]["device_blocks"], hyb["hh"]["cached_blocks"], hyb["hh"]["kv_blocks"]) == (n_hh,) * 3
    assert hyb.get("flood", {}).get("kv_blocks", 0) == 0
    fl = {x["worker_id"]: x for x in scorer.last()["workers"]}
    assert fl["flood"]["kv_blocks"] == FLOOD_BLOCKS and fl.get("hh", {}).get("kv_blocks", 0) == 0, fl
    assert scorer.answers and not scorer.errors, scorer.errors[:3]


def check_soak_end(label: str, metrics: str, flood: GroupFlood, group_cap: int, slow: list[socket.socket],
                   probe: HealthProbe, scorer: LargeScores, pid: int, rss0: int, p99_bound_ms: float | None,
                   rounds: int, thefts: int) -> None:
    """What both hostile soaks assert at their end: every group store past the flood's first
    `group_cap` groups dropped and counted, every slowloris socket closed by the server, /health
    always answered, RSS bounded; the /health p99 bound only where given (the long mode)."""
    assert group_limit_drops(metrics) >= (flood.group_batch - group_cap) * flood.batches > 0
    closed_by_server(slow)
    assert not probe.errors, probe.errors[:3]
    n_health, p50, p99 = probe.summary()
    rss1 = rss_kb(pid)
    print(f"{label} soak: {rounds} rounds, {thefts} theft attempts, {len(slow)} slowloris sockets, "
          f"{len(scorer.answers)} 480k-token scores, /health p50 {p50:.1f} ms p99 {p99:.1f} ms over {n_health}, "
          f"RSS {rss0} -> {rss1} kB")
    assert rss1 < rss0 + 256 * 1024, (rss0, rss1)  # bounded: no growth with the hostile traffic
    if p99_bound_ms is not None:
        assert p99 < p99_bound_ms, p99


class HighSeqPublisher:
    """A raw ZeroMQ PUB with honest content whose seqs start past 2^63 (wire seqs are u64; issue 24
    item 5): `send` publishes one batch, `last_seq` is the seq of the last one sent."""

    def __init__(self, first_seq: int = (1 << 63) + 7) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.next_seq = first_seq
        self._enc = msgspec.msgpack.Encoder()

    @property
    def last_seq(self) -> int:
        return self.next_seq - 1

    def send(self, events: list) -> None:
        self.sock.send_multipart([b"", seq_bytes(self.next_seq), self._enc.encode(KVEventBatch(time.time(), events))])
        self.next_seq += 1

    def close(self) -> None:
        self.sock.close(0)


def start_flood(url: str, hh_pub, flood_pub, hh_events: list, flood: GroupFlood) -> tuple[HealthProbe, LargeScores]:
    """Starts what the hostile soaks measure under: the /health probe, the honest hybrid worker's
    events, the group flood's chain and the back-to-back 480k-token scores of it."""
    probe = HealthProbe(url)
    hh_pub.publish(hh_events)
    for batch in flood.chain():
        flood_pub.publish(batch)
    return probe, LargeScores(url, flood.score_body)


def wait_applied(client: httpx.Client, marks: dict[str, int], nudge: Callable[[], None], timeout: float) -> None:
    """Until every worker in `marks` has applied up to its seq there; `nudge` runs before each look
    (heartbeats: a lost last batch is noticed, and replayed, at the next message)."""
    def applied() -> bool:
        nudge()
        rows = {x["worker_id"]: x for x in client.get("/workers").json()["workers"]}
        return all((rows.get(w, {}).get("last_seq") or 0) >= m for w, m in marks.items())
    try:
        wait_until(applied, timeout=timeout, interval=0.1)
    except AssertionError:
        rows = {x["worker_id"]: (x["last_seq"], x["status"], x["gaps"]) for x in client.get("/workers").json()["workers"]}
        raise AssertionError(f"not applied: marks {marks} rows {rows}") from None


def stop_parties(scorer: LargeScores | None, probe: HealthProbe | None, slow: list[socket.socket]) -> None:
    """The soak's own load and probes, stopped whatever state the soak ended in."""
    if scorer is not None:
        scorer.stop()
    if probe is not None:
        probe.stop()
    for s in slow:
        s.close()
