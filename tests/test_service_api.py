"""HTTP API of the indexer service against a real uvicorn server and a real ZMQ publisher:
registration rules, /score in JSON / msgpack / raw u32 bodies, /query compat, validation
(400/404/413/415/422), bearer auth, and that bad requests are counted while the service stays up."""
from __future__ import annotations

import struct
from typing import Iterator

import httpx
import msgspec
import numpy as np
import pytest

from support.net import free_port, wait_until
from producer.publisher import ZmqEventPublisher
from router_api.config import ServiceConfig
from support.service import LiveIndexer, WorkerSim, make_prompts, wait_applied

BS = 4


@pytest.fixture(scope="module")
def live() -> Iterator[LiveIndexer]:
    li = LiveIndexer(ServiceConfig(port=free_port(), block_size=BS, stats_ttl_s=0.0)).start()
    try:
        yield li
    finally:
        li.stop()


@pytest.fixture(scope="module")
def fed(live: LiveIndexer) -> Iterator[tuple[LiveIndexer, dict[str, WorkerSim]]]:
    """Two workers registered and streamed to; yields the server and the simulated caches."""
    pubs, sims = {}, {}
    prompts = make_prompts(7, BS)
    for i in range(2):
        ep, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        pub = ZmqEventPublisher(ep, replay_endpoint=rep)
        pubs[f"api-w{i}"] = pub
        wid = f"api-w{i}"
        r = live.client.post("/workers", json={"worker_id": wid, "endpoint": ep, "replay_endpoint": rep,
                                                "block_size": BS})
        assert r.status_code == 201, r.text
        sims[wid] = sim = WorkerSim(100 + i, BS, prompts)
        for _ in range(60):
            pub.publish(sim.step())
        pub.flush(5)
    wait_applied(live.client, {wid: 59 for wid in sims}, pubs=pubs)
    try:
        yield live, sims
    finally:
        for wid in sims:
            live.client.delete(f"/workers/{wid}")
        for p in pubs.values():
            p.close()


def _rejects(client: httpx.Client, endpoint: str, reason: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'kvatlas_http_rejects_total{{endpoint="{endpoint}",reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# --- registration ------------------------------------------------------------------------------

def test_registration_rules(live: LiveIndexer) -> None:
    c = live.client
    ep = f"tcp://127.0.0.1:{free_port()}"
    r = c.post("/workers", json={"worker_id": "reg-a", "endpoint": ep, "block_size": BS})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["worker_id"] == "reg-a" and body["status"] == "connecting" and body["model"] == "default"
    assert body["blocks"] == {"gpu": 0, "host": 0, "disk": 0, "shared": 0}

    dup = c.post("/workers", json={"worker_id": "reg-a", "endpoint": f"tcp://127.0.0.1:{free_port()}",
                                   "block_size": BS})
    assert dup.status_code == 409 and "already registered" in dup.json()["error"]
    same_ep = c.post("/workers", json={"worker_id": "reg-b", "endpoint": ep, "block_size": BS})
    assert same_ep.status_code == 409

    for bad in ("localhost:5557", "tcp://127.0.0.1", "tcp://127.0.0.1:99999", "http://x:1", ""):
        r = c.post("/workers", json={"worker_id": "reg-bad", "endpoint": bad, "block_size": BS})
        assert r.status_code in (400, 422), (bad, r.status_code, r.text)
        assert "error" in r.json()
    r = c.post("/workers", json={"worker_id": "reg-bad", "endpoint": f"tcp://127.0.0.1:{free_port()}",
                                 "replay_endpoint": "nonsense"})
    assert r.status_code == 400 and "replay_endpoint" in r.json()["error"]

    conflict = c.post("/workers", json={"worker_id": "reg-c", "endpoint": f"tcp://127.0.0.1:{free_port()}",
                                        "block_size": BS * 2})
    assert conflict.status_code == 409 and "block_size" in conflict.json()["error"]
    # A different model may use its own block size.
    other = c.post("/workers", json={"worker_id": "reg-d", "endpoint": f"tcp://127.0.0.1:{free_port()}",
                                     "model": "other", "block_size": BS * 2})
    assert other.status_code == 201, other.text

    unknown_field = c.post("/workers", json={"worker_id": "reg-e", "endpoint": f"tcp://127.0.0.1:{free_port()}",
                                             "colour": "red"})
    assert unknown_field.status_code == 422
    assert c.post("/workers", content=b"{not json", headers={"content-type": "application/json"}).status_code == 400

    mp = c.post("/workers", content=msgspec.msgpack.encode(
        {"worker_id": "reg-mp", "endpoint": f"tcp://127.0.0.1:{free_port()}", "block_size": BS}),
        headers={"content-type": "application/msgpack"})
    assert mp.status_code == 201, mp.text

    listed = {w["worker_id"]: w for w in c.get("/workers").json()["workers"]}
    assert {"reg-a", "reg-d", "reg-mp"} <= set(listed)
    assert "reg-bad" not in listed and "reg-c" not in listed
    assert listed["reg-d"]["block_size"] == BS * 2

    for wid in ("reg-a", "reg-d", "reg-mp"):
        assert c.delete(f"/workers/{wid}").status_code == 200
    gone = c.delete("/workers/reg-a")
    assert gone.status_code == 404 and "not registered" in gone.json()["error"]
    assert not {"reg-a", "reg-d", "reg-mp"} & {w["worker_id"] for w in c.get("/workers").json()["workers"]}


# --- scoring -----------------------------------------------------------------------------------

def test_score_json_matches_simulated_caches(fed: tuple[LiveIndexer, dict[str, WorkerSim]]) -> None:
    live, sims = fed
    checked = hits = 0
    for sim in sims.values():
        for q in sim.sample_queries(15):
            body = live.client.post("/score", json={"token_ids": q}).json()
            assert body["model"] == "default" and body["block_size"] == BS
            assert body["query_blocks"] == len(q) // BS
            got = {w["worker_id"]: w for w in body["workers"]}
            assert set(got) == set(sims)
            for wid, s in sims.items():
                exp = s.expect(q)
                assert got[wid]["cached_blocks"] == exp["cached_blocks"], (wid, q)
                assert got[wid]["device_blocks"] == exp["device_blocks"]
                assert got[wid]["tiers"] == exp["tiers"]
                assert got[wid]["stale"] is False and got[wid]["last_seq"] >= 59
            scores = [w["score"] for w in body["workers"]]
            assert scores == sorted(scores, reverse=True)
            if scores[0] > 0:
                hits += 1
                assert body["best"] == {"worker_id": body["workers"][0]["worker_id"],
                                        "dp_rank": body["workers"][0]["dp_rank"]}
            else:
                assert body["best"] is None
            checked += 1
    assert checked == 30 and hits >= 10  # the queries really exercise cached prefixes


def test_binary_bodies_give_the_same_answer(fed: tuple[LiveIndexer, dict[str, WorkerSim]]) -> None:
    live, sims = fed
    c = live.client
    for q in next(iter(sims.values())).sample_queries(8):
        as_json = c.post("/score", json={"token_ids": q}).json()
        as_mp = c.post("/score", content=msgspec.msgpack.encode({"token_ids": q, "model": "default"}),
                       headers={"content-type": "application/msgpack"})
        assert as_mp.status_code == 200 and as_mp.json() == as_json
        raw = np.asarray(q, dtype="<u4").tobytes()
        as_octet = c.post("/score?model=default", content=raw,
                          headers={"content-type": "application/octet-stream"})
        assert as_octet.status_code == 200 and as_octet.json() == as_json
        mp_out = c.post("/score", content=raw, headers={"content-type": "application/octet-stream",
                                                        "accept": "application/msgpack"})
        assert mp_out.headers["content-type"] == "application/msgpack"
        assert msgspec.msgpack.decode(mp_out.content) == as_json


def test_streamed_bodies_and_other_methods_on_the_fast_endpoints(fed: tuple[LiveIndexer, dict[str, WorkerSim]]) -> None:
    """/score and /query are served ahead of FastAPI: a body arriving in many chunks (no
    Content-Length) gives the same answer, and a non-POST gets a JSON 405."""
    live, sims = fed
    c = live.client
    q = next(iter(sims.values())).sample_queries(1)[0] * 3
    want = c.post("/score", json={"token_ids": q}).json()
    assert want["query_blocks"] == len(q) // BS
    raw = np.asarray(q, dtype="<u4").tobytes()
    pieces = [raw[i:i + 7] for i in range(0, len(raw), 7)]
    got = c.post("/score", content=iter(pieces), headers={"content-type": "application/octet-stream"})
    assert got.status_code == 200 and got.json() == want
    body = msgspec.json.encode({"token_ids": q})
    got = c.post("/score", content=iter([body[:5], body[5:]]), headers={"content-type": "application/json"})
    assert got.status_code == 200 and got.json() == want
    compat = c.post("/query", content=iter([raw[:4], raw[4:]]),
                    headers={"content-type": "application/octet-stream"})
    assert compat.status_code == 200 and set(compat.json()["instances"]) == set(sims)
    for path in ("/score", "/query"):
        r = c.get(path)
        assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]


def test_namespaces_do_not_mix(fed: tuple[LiveIndexer, dict[str, WorkerSim]]) -> None:
    live, sims = fed
    q = next(iter(sims.values())).history[-1]
    plain = live.client.post("/score", json={"token_ids": q}).json()
    assert plain["workers"][0]["cached_blocks"] > 0
    for extra in ({"lora_name": "adapter-x"}, {"cache_salt": "tenant-1"}):
        body = live.client.post("/score", json={"token_ids": q, **extra}).json()
        assert all(w["cached_blocks"] == 0 for w in body["workers"]) and body["best"] is None


def test_query_compat_shape(fed: tuple[LiveIndexer, dict[str, WorkerSim]]) -> None:
    live, sims = fed
    wid, sim = next(iter(sims.items()))
    q = sim.history[-1]
    exp = sim.expect(q)
    r = live.client.post("/query", json={"model_name": "default", "token_ids": q})
    assert r.status_code == 200, r.text
    inst = r.json()["instances"]
    assert set(inst) == set(sims)
    mine = inst[wid]
    assert mine["longest_matched"] == exp["cached_blocks"] * BS
    assert mine["gpu"] == exp["tiers"]["gpu"] * BS and mine["cpu"] == exp["tiers"]["host"] * BS
    assert mine["disk"] == 0 and mine["dp"] == {"0": exp["cached_blocks"] * BS}


def test_bad_requests_are_rejected_counted_and_survived(fed: tuple[LiveIndexer, dict[str, WorkerSim]]) -> None:
    live, _ = fed
    c = live.client
    before = {k: _rejects(c, "score", k) for k in ("bad_json", "bad_msgpack", "invalid", "too_large",
                                                   "bad_content_type", "unknown_model", "empty_body")}
    cases = [
        (dict(content=b'{"token_ids": [1, 2', headers={"content-type": "application/json"}), 400, "bad_json"),
        (dict(content=b"\xc1\xc1\xc1", headers={"content-type": "application/msgpack"}), 400, "bad_msgpack"),
        (dict(json={"token_ids": [1, 2, 2 ** 32]}), 422, "invalid"),
        (dict(json={"token_ids": [1, -1]}), 422, "invalid"),
        (dict(json={"token_ids": "abc"}), 422, "invalid"),
        (dict(json={"tokens": [1, 2]}), 422, "invalid"),
        (dict(content=b"\x01\x00\x00", headers={"content-type": "application/octet-stream"}), 422, "invalid"),
        (dict(content=b"tokens", headers={"content-type": "text/plain"}), 415, "bad_content_type"),
        (dict(json={"token_ids": [1, 2, 3, 4], "model": "nope"}), 404, "unknown_model"),
        (dict(content=b"", headers={"content-type": "application/json"}), 400, "empty_body"),
    ]
    for kwargs, status, reason in cases:
        r = c.post("/score", **kwargs)
        assert r.status_code == status, (kwargs, r.status_code, r.text)
        assert isinstance(r.json()["error"], str) and r.json()["error"]

    # Oversize: announced by Content-Length, and streamed (chunked, no length) — both 413.
    big = b"\x00" * (live.service.config.max_body_bytes + 4)
    r = c.post("/score", content=big, headers={"content-type": "application/octet-stream"})
    assert r.status_code == 413
    r = c.post("/score", content=iter([big[: len(big) // 2], big[len(big) // 2:]]),
               headers={"content-type": "application/octet-stream"})
    assert r.status_code == 413
    # Absurd length below the byte limit: more tokens than any context -> 422.
    n = 2_000_001
    r = c.post("/score", content=b"\x01\x00\x00\x00" * n, headers={"content-type": "application/octet-stream"})
    assert r.status_code == 422 and "limit" in r.json()["error"]

    after = {k: _rejects(c, "score", k) for k in before}
    assert after["bad_json"] - before["bad_json"] == 1
    assert after["bad_msgpack"] - before["bad_msgpack"] == 1
    assert after["invalid"] - before["invalid"] == 6
    assert after["too_large"] - before["too_large"] == 2
    assert after["bad_content_type"] - before["bad_content_type"] == 1
    assert after["unknown_model"] - before["unknown_model"] == 1
    assert c.get("/health").json()["status"] == "ok"
    assert c.post("/score", json={"token_ids": [1, 2, 3, 4]}).status_code == 200
    assert c.get("/nowhere").json() == {"error": "Not Found", "detail": None}


def test_health_dump_metrics(fed: tuple[LiveIndexer, dict[str, WorkerSim]]) -> None:
    live, sims = fed
    c = live.client
    h = c.get("/health").json()
    assert h["status"] == "ok" and h["ingest_alive"] and h["workers"] >= 2 and h["models"]["default"] == BS
    core = "native" if live.service.index.native else "python"
    assert h["core"] == core  # the index core in use is visible (docs/service.md)
    dump = c.get("/dump").json()
    workers = {w["worker_id"]: w for w in dump["models"]["default"]["workers"]}
    for wid, sim in sims.items():
        stored = {h for ev in workers[wid]["events"] if ev["type"] == "BlockStored" for h in ev["block_hashes"]}
        assert stored == {h for h, b in sim.blocks.items() if b.tiers}
        assert dump["watermarks"][wid] >= 59
    text = c.get("/metrics").text
    assert 'kvatlas_events_applied_total{outcome="new",tier="GPU",type="stored"}' in text
    assert 'kvatlas_request_seconds_bucket{endpoint="score",le="+Inf"}' in text
    assert f'kvatlas_index_core{{core="{core}"}} 1.0' in text
    rows = {w["worker_id"]: w for w in c.get("/workers").json()["workers"]}
    for wid, sim in sims.items():
        assert rows[wid]["status"] == "live" and rows[wid]["last_seq"] >= 59
        assert rows[wid]["blocks"]["gpu"] == sum("GPU" in b.tiers for b in sim.blocks.values())
        assert rows[wid]["blocks"]["host"] == sum("CPU_PINNED" in b.tiers for b in sim.blocks.values())
        assert f'kvatlas_worker_blocks{{tier="gpu",worker="{wid}"}} {rows[wid]["blocks"]["gpu"]}' in text


@pytest.mark.asyncio
async def test_bearer_token() -> None:
    """In process through the ASGI app (httpx.AsyncClient): no server thread or port needed."""
    from router_api.app import create_app
    from router_api.service import IndexerService

    svc = IndexerService(ServiceConfig(block_size=BS, auth_token="s3cret"))
    svc.index.ensure_model("default", BS)
    transport = httpx.ASGITransport(app=create_app(svc))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as anon, \
            httpx.AsyncClient(transport=transport, base_url="http://t",
                              headers={"Authorization": "Bearer s3cret"}) as authed:
        assert (await anon.get("/health")).status_code == 200
        for method, path in (("POST", "/score"), ("GET", "/workers"), ("GET", "/metrics"), ("GET", "/"),
                             ("GET", "/dump"), ("POST", "/workers"), ("DELETE", "/workers/x")):
            r = await anon.request(method, path, json={"token_ids": [1]})
            assert r.status_code == 401, (method, path, r.status_code)
            assert r.headers["www-authenticate"] == "Bearer" and r.json()["error"]
        wrong = await anon.post("/score", json={"token_ids": [1]}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert (await authed.post("/score", json={"token_ids": [1, 2, 3, 4]})).status_code == 200
        assert (await anon.get("/?token=s3cret")).status_code == 200
        assert (await anon.get("/?token=wrong")).status_code == 401
        assert (await anon.get("/stats?token=s3cret")).status_code == 401  # query token is for the page only
