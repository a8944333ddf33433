"""`POST /routes/decide` (router_api/decide.py): score, choose and reserve in one step. Two
decisions for a new shared prefix, back to back with nothing else between them, land on one worker
with the second counting the first's pending blocks; the router's own choice is recorded as sent;
an unknown worker is refused for that route only; bad bodies are 4xx; without a chooser only a
request carrying its `choice` is served; `POST /routes/release` and `release` riding on a decision
forget routes; the service's decisions race-free from threads (the decision lock)."""
from __future__ import annotations

import threading

import msgspec
import numpy as np

from router.decision import PolicyChooser
from router_api.config import ServiceConfig
from router_api.decide import Candidate, Decider, DecideRequest, ReleaseRequest
from router_api.routes import UnknownRouteWorker, route_handle
from router_api.service import UnknownModel
from support.net import free_port
from support.service import LiveIndexer

MP = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}


def _register(idx: LiveIndexer, *workers: str) -> None:
    for w in workers:
        assert idx.client.post("/workers", json={"worker_id": w, "endpoint": f"tcp://127.0.0.1:{free_port()}",
                                                 "model": "default", "block_size": 4}).status_code == 201


def _req(rid: str, tokens: np.ndarray, **kw: object) -> bytes:
    return msgspec.msgpack.encode(DecideRequest(rid, [Candidate("w0"), Candidate("w1")],
                                                tokens=tokens.astype("<u4").tobytes(), **kw))


def test_decisions_see_each_others_pending_blocks() -> None:
    shared = np.arange(1, 401, dtype=np.uint32)  # 100 blocks nobody holds yet
    with LiveIndexer(ServiceConfig(port=free_port(), block_size=4)) as idx:
        _register(idx, "w0", "w1")
        answers = []
        for i in range(4):
            q = np.concatenate([shared, np.arange(10_000 + 8 * i, 10_008 + 8 * i, dtype=np.uint32)])
            r = idx.client.post("/routes/decide", content=_req(f"r{i}", q, admits=True), headers=MP)
            assert r.status_code == 200, r.text
            answers.append(msgspec.msgpack.decode(r.content))
        assert len({a["worker_id"] for a in answers}) == 1
        assert all(a["reserved"] for a in answers)
        assert answers[0].get("pending_blocks", 0) == 0 and answers[0].get("predicted_cached_tokens") == 0
        for a in answers[1:]:
            assert a["pending_blocks"] == 100 and a["predicted_cached_tokens"] == 400
            # causal forwarding: after the routes that store the prefix (named by handles, never by id)
            assert route_handle(idx.service.routes.handle_key, "default", "r0") in a["after"]
        # the router's own choice, recorded as sent; an unknown worker is refused for that route only
        r = msgspec.msgpack.decode(idx.client.post("/routes/decide", headers=MP, content=msgspec.msgpack.encode(
            DecideRequest("x", [Candidate("w0"), Candidate("ghost")], token_ids=list(range(1, 9)),
                          choice="ghost"))).content)
        assert r["worker_id"] == "ghost" and not r.get("reserved") and r["refused"].startswith("unknown_worker")
        r = msgspec.msgpack.decode(idx.client.post("/routes/decide", headers=MP, content=_req(
            "y", shared[:8], choice="w1", release=["r0", "r1"])).content)
        assert r["worker_id"] == "w1" and r["reserved"]
        counts = idx.service.routes.pending.counts
        assert counts.released == 2
        rel = idx.client.post("/routes/release", json={"request_ids": ["r2", "r3", "nope"]})
        assert rel.status_code == 200 and rel.json()["released"] == 2 and counts.released == 4


def test_bad_decisions_are_refused() -> None:
    with LiveIndexer(ServiceConfig(port=free_port(), block_size=4)) as idx:
        _register(idx, "w0")
        post = idx.client.post
        assert post("/routes/decide", json={"request_id": "a", "candidates": []}).status_code == 422
        assert post("/routes/decide", json={"request_id": "a", "candidates": [{"worker_id": "w0"}]}).status_code == 422
        assert post("/routes/decide", json={"request_id": "a", "candidates": [{"worker_id": "w0"}],
                                            "token_ids": [1, 2, 3, 4], "policy": "nope"}).status_code == 422
        assert post("/routes/decide", json={"request_id": "a", "candidates": [{"worker_id": "w0"}],
                                            "token_ids": [1, 2, 3, 4], "choice": "w9"}).status_code == 422
        assert post("/routes/decide", json={"request_id": "a", "candidates": [{"worker_id": "w0"}] * 2,
                                            "token_ids": [1, 2, 3, 4]}).status_code == 422
        deep = b'{"request_id": "a", "candidates": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        assert post("/routes/decide", content=deep, headers={"Content-Type": "application/json"}).status_code in (400, 422)
        ok = post("/routes/decide", json={"request_id": "a", "candidates": [{"worker_id": "w0"}],
                                          "token_ids": [1, 2, 3, 4], "model": "unknown"})
        assert ok.status_code == 200 and ok.json()["scored"] is False and ok.json()["refused"].startswith("unknown_model")


def test_without_a_chooser_only_the_routers_choice_is_served() -> None:
    with LiveIndexer(ServiceConfig(port=free_port(), block_size=4)) as idx:
        dec = Decider(idx.service, None, UnknownModel, UnknownRouteWorker)
        req = DecideRequest("a", [Candidate("w0")], token_ids=[1, 2, 3, 4])
        try:
            dec.decide(req)
        except LookupError as exc:
            assert "choice" in str(exc)
        else:
            raise AssertionError("decided without a chooser")
        assert dec.decide(DecideRequest("b", [Candidate("w0")], token_ids=[1, 2, 3, 4], choice="w0")).worker_id == "w0"
        assert dec.release(ReleaseRequest(["b"])).released == 0  # never recorded: the model is unknown


def test_decisions_from_threads_are_serialized() -> None:
    """Eight threads decide at once for one new prefix: on each worker, every decision after the first
    there counts the pending blocks (none scored between another's score and its reservation)."""
    shared = list(range(1, 201))
    with LiveIndexer(ServiceConfig(port=free_port(), block_size=4)) as idx:
        _register(idx, "w0", "w1")
        dec = Decider(idx.service, PolicyChooser(), UnknownModel, UnknownRouteWorker)
        out: list[object] = []
        start = threading.Barrier(8)

        def one(i: int) -> None:
            start.wait()
            out.append(dec.decide(DecideRequest(f"t{i}", [Candidate("w0"), Candidate("w1")],
                                                token_ids=shared + [5000 + i] * 4)))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(out) == 8
        per_worker: dict[str, list[int]] = {}
        for a in out:
            per_worker.setdefault(a.worker_id, []).append(a.pending_blocks)
        for pending in per_worker.values():  # the first decision for a worker found nothing pending there,
            assert sorted(pending) == [0] + [50] * (len(pending) - 1)  # every later one its 50 blocks


def test_decisions_are_served_ahead_of_fastapi() -> None:
    """`/routes/decide` is a score-front route (as `/score`): answered with FastAPI out of the way,
    and found by the protocol fast path (router_api/fasthttp.py) by its raw target."""
    with LiveIndexer(ServiceConfig(port=free_port(), block_size=4)) as idx:
        _register(idx, "w0", "w1")
        front = idx.app

        async def gone(scope: dict, receive: object, send: object) -> None:
            raise RuntimeError("FastAPI was reached")

        front.app = gone
        r = idx.client.post("/routes/decide", content=_req("a", np.arange(1, 41, dtype=np.uint32)), headers=MP)
        assert r.status_code == 200 and msgspec.msgpack.decode(r.content)["worker_id"] in ("w0", "w1")
        r = idx.client.post("/routes/decide", json={"request_id": "b", "candidates": [], "token_ids": [1, 2]})
        assert r.status_code == 422 and "error" in r.json()  # refused by the decider, still without FastAPI
        r = idx.client.post("/routes/decide", content=b"\x01\x00\x00\x00",
                            headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 415
        assert front.raw_routes[b"/routes/decide"].structured
