"""Large /score bodies answered off the event loop (router_api/offload.py): on real uvicorn servers (the
protocol fast path and the ASGI front), /health answers while a large /score is in progress (the test
holds the index lock, so that score cannot finish until it lets go), answers stay byte-identical, a
request pipelined behind an off-loop answer is answered after it, a full pool answers 503 (counted);
and the GIL-free C scans (bodies >= 64 KiB, >= 16384 tokens hashed) agree with the typed decoder and
the pure core."""
from __future__ import annotations

import random
import socket
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import msgspec
import numpy as np
import pytest

from indexer.core import native as native_core
from indexer.index import KVIndex
from router_api.app import create_app
from router_api.bodies import ApiError, TokenBodies
from router_api.config import ServiceConfig
from router_api.offload import OFFLOAD_MIN_BYTES, AnswerPool
from router_api.service import IndexerService
from schemas.api import RegisterWorker, ScoreRequest
from schemas.events import BlockStored, KVEventBatch
from producer.publisher import ZmqEventPublisher
from support.hostile import FLOOD_BLOCKS, FLOOD_BS, GroupFlood, LargeScores
from support.service import serve_both_fronts
from support.net import free_port, wait_until
from support.service import KVIndexerProcess

pytestmark = pytest.mark.skipif(not native_core.available(), reason="native module not built")

BS = 4
PROMPT = [random.Random(3).randrange(1, 50_000) for _ in range(80_000)]  # JSON body ~470 KB
HELD = 64  # blocks of PROMPT worker w0 holds


class Served:
    """One service behind two real uvicorn servers (`fast`: the protocol fast path; `asgi`)."""

    def __init__(self, pool: AnswerPool | None = None) -> None:
        self.service = IndexerService(ServiceConfig(block_size=BS, max_body_bytes=8 << 20, ingest_shards=1))
        svc = self.service
        svc.index.ensure_model("default", BS)
        svc.registry.add(RegisterWorker(worker_id="w0", endpoint="tcp://127.0.0.1:1", block_size=BS), svc.clock())
        svc.index.register_worker("default", "w0", 0)
        svc.index.apply("default", "w0", 0, KVEventBatch(0.0, [
            BlockStored(list(range(1, HELD + 1)), None, PROMPT[:HELD * BS], BS)]))
        self.app = create_app(svc, pool=pool)
        self.front = self.app
        self.servers = serve_both_fronts(self.app)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.servers[name][2]}"

    def close(self) -> None:
        for server, t, _p in self.servers.values():
            server.should_exit = True
            t.join(10)
        self.front.pool.close()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def _body(n: int = len(PROMPT)) -> bytes:
    return msgspec.json.encode({"token_ids": PROMPT[:n]})


class Posted:
    """One POST in a thread; `.resp` once answered."""

    def __init__(self, url: str, body: bytes) -> None:
        self.resp: httpx.Response | None = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.resp = httpx.post(url + "/score", content=body, headers={"content-type": "application/json"},
                                       timeout=60)
            except BaseException as exc:  # reported by the test
                self.error = exc
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> httpx.Response:
        self.thread.join(60)
        assert self.error is None and self.resp is not None, self.error
        return self.resp


@pytest.mark.parametrize("path", ["fast", "asgi"])
def test_health_answers_while_a_large_score_is_in_progress(served: Served, path: str) -> None:
    body = _body()
    assert len(body) >= OFFLOAD_MIN_BYTES
    pool = served.front.pool
    with served.service.lock:  # the large score cannot finish before this block ends
        big = Posted(served.url(path), body)
        wait_until(lambda: pool.pending == 1, timeout=30)  # decoded, on a pool thread, waiting for the lock
        health = httpx.get(served.url(path) + "/health", timeout=30)  # sent after the score started ...
        assert health.status_code == 200  # ... and answered before it
        assert big.resp is None
    resp = big.join()
    assert resp.status_code == 200
    # byte-identical to the answer computed on the caller's thread
    status, direct, _ = served.front.answer(served.front.routes["/score"], "json", None, b"", body, 0.0)
    assert status == 200 and resp.content == direct
    row = resp.json()["workers"][0]
    assert (row["worker_id"], row["device_blocks"], resp.json()["query_blocks"]) == ("w0", HELD, len(PROMPT) // BS)


def _offload_pending(metrics: str) -> float:
    line = next(x for x in metrics.splitlines() if x.startswith("kvatlas_http_offload_pending "))
    return float(line.split()[1])


def test_a_real_indexer_answers_while_a_large_score_runs(tmp_path: Path) -> None:
    """`kvatlas indexer` with a 30,000-block chain scored at 480k tokens back to back by two clients:
    a /metrics scrape — answered on the event loop — finds an off-loop answer queued or running (the
    loop served it meanwhile; on the loop no request is read while a score runs), /health answers
    throughout, and every score is exact."""
    r = KVIndexerProcess(free_port(), "--block-size", "4", log_path=tmp_path / "indexer.log")
    pub = ZmqEventPublisher("tcp://127.0.0.1:*")
    scorers: list[LargeScores] = []
    try:
        r.wait_ready()
        flood = GroupFlood(3)
        assert r.client.post("/workers", json={"worker_id": "w0", "endpoint": pub.endpoint, "block_size": FLOOD_BS,
                                               "model": "hyb"}).status_code == 201

        def joined() -> bool:
            pub.heartbeat()
            return r.client.get("/workers").json()["workers"][0]["last_seq"] is not None
        wait_until(joined, timeout=30, interval=0.05)
        for batch in flood.chain():
            pub.publish(batch)
        assert pub.flush(30)
        mark = pub.next_seq - 1
        wait_until(lambda: (r.client.get("/workers").json()["workers"][0]["last_seq"] or 0) >= mark, timeout=60,
                   interval=0.05)
        scorers = [LargeScores(r.url, flood.score_body) for _ in range(2)]
        seen: list[float] = []

        def caught_in_progress() -> bool:
            assert r.client.get("/health").status_code == 200
            seen.append(_offload_pending(r.client.get("/metrics").text))
            return seen[-1] >= 1
        wait_until(caught_in_progress, timeout=120, interval=0.002)
        for sc in scorers:
            sc.stop()
        assert not any(sc.errors for sc in scorers), [sc.errors[:2] for sc in scorers]
        answers = [a for sc in scorers for a in sc.answers]
        assert answers and all(a["workers"][0]["device_blocks"] == FLOOD_BLOCKS for a in answers)
        assert _offload_pending(r.client.get("/metrics").text) == 0
    finally:
        for sc in scorers:
            sc.stop()
        pub.close()
        r.terminate()


def _post(path: bytes, body: bytes) -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def _responses(sock: socket.socket, n: int) -> list[tuple[int, bytes]]:
    """n whole responses (status, body) read from sock, in order."""
    buf, out = b"", []
    while len(out) < n:
        head, sep, rest = buf.partition(b"\r\n\r\n")
        if sep:
            clen = next(int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:"))
            if len(rest) >= clen:
                out.append((int(head.split(b" ")[1]), rest[:clen]))
                buf = rest[clen:]
                continue
        chunk = sock.recv(1 << 16)
        assert chunk, f"closed after {len(out)} responses"
        buf += chunk
    return out


def test_a_request_pipelined_behind_an_off_loop_answer_waits_for_it(served: Served) -> None:
    body = _body()
    port = served.servers["fast"][2]
    pool = served.front.pool
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        with served.service.lock:
            s.sendall(_post(b"/score", body) + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n" + _post(b"/score", _body(8)))
            wait_until(lambda: pool.pending == 1, timeout=30)
        (st1, b1), (st2, b2), (st3, b3) = _responses(s, 3)
    assert (st1, st2, st3) == (200, 200, 200)
    assert msgspec.json.decode(b1)["query_blocks"] == len(PROMPT) // BS
    assert msgspec.json.decode(b2)["workers"] == 1  # the /health answer, in its place
    assert msgspec.json.decode(b3)["query_blocks"] == 2


def test_a_full_pool_answers_503_and_counts_it() -> None:
    s = Served(AnswerPool(min_bytes=1024, threads=1, max_pending=2))
    try:
        body = _body(2_000)
        for path in ("fast", "asgi"):
            with s.service.lock:
                held = [Posted(s.url(path), body) for _ in range(2)]
                wait_until(lambda: s.front.pool.pending == 2, timeout=30)
                over = httpx.post(s.url(path) + "/score", content=body, headers={"content-type": "application/json"},
                                  timeout=30)
                assert over.status_code == 503 and "busy" in over.json()["error"]
            assert [p.join().status_code for p in held] == [200, 200]
        metrics = httpx.get(s.url("fast") + "/metrics", timeout=30).text
        assert 'kvatlas_http_rejects_total{endpoint="score",reason="offload_full"} 2.0' in metrics
        assert s.front.pool.pending == 0
    finally:
        s.close()


def test_offload_off_answers_on_the_loop() -> None:
    pool = AnswerPool(min_bytes=0)
    assert not pool.wants(1 << 30)
    with pytest.raises(ValueError):
        AnswerPool(threads=2, max_pending=1)


# --- the GIL-free scans: large inputs, the paths small fuzz bodies never reach -----------------------

NATIVE = TokenBodies(True)
PURE = TokenBodies(False)


def _outcome(tb: TokenBodies, kind: str, body: bytes) -> Any:
    try:
        req, toks = tb.decode(kind, body, ScoreRequest)
    except ApiError as exc:
        return ("error", exc.status, exc.message, exc.reason)
    return ("ok", req.model, [int(t) for t in toks])


def _mutated(rng: random.Random, body: bytes) -> bytes:
    i = rng.randrange(len(body))
    how = rng.randrange(4)
    if how == 0:
        return body[:i]
    if how == 1:
        return body[:i] + bytes([rng.randrange(256)]) + body[i + 1:]
    if how == 2:
        return body[:i] + b"-" + body[i:]
    return body


@pytest.mark.parametrize("kind", ["json", "msgpack"])
def test_large_bodies_decode_like_the_typed_decoder(kind: str) -> None:
    rng = random.Random(kind)
    enc = msgspec.json.encode if kind == "json" else msgspec.msgpack.encode
    for case in range(40):
        toks = [rng.choice([rng.randrange(1 << 32), rng.randrange(100), 0]) for _ in range(rng.randrange(32_000, 60_000))]
        doc: dict[str, Any] = {"token_ids": toks}
        if case % 3:
            doc = {"model": "m", **doc} if case % 2 else {**doc, "lora_name": None}
        body = enc(doc)
        assert len(body) >= 64 * 1024  # the scans run without the GIL
        for b in (body, _mutated(rng, body)):
            assert _outcome(NATIVE, kind, b) == _outcome(PURE, kind, b)
    over = enc({"token_ids": [1] * 70_000 + [1 << 32]})  # one token out of range, at the end
    assert _outcome(NATIVE, kind, over) == _outcome(PURE, kind, over)


def test_large_queries_hash_like_the_pure_core() -> None:
    rng = random.Random(5)
    bs = 16
    toks = [rng.randrange(50_000) for _ in range(40_000)]  # 2,500 blocks: the digests run without the GIL
    hashes = rng.sample(range(1, 1 << 62), len(toks) // bs)
    out = []
    for native in (True, False):
        idx = KVIndex(native=native)
        idx.ensure_model("m", bs)
        idx.apply("m", "w", 0, KVEventBatch(0.0, [BlockStored(hashes[:2_000], None, toks[:2_000 * bs], bs)]))
        out.append(idx.score("m", np.asarray(toks, dtype="<u4")))
    assert out[0] == out[1]
    assert out[0].workers[0].device_blocks == 2_000
