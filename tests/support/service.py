"""Shared harness for the indexer-service tests (no tests of its own).

- `LiveIndexer`: an IndexerService + a real uvicorn server on 127.0.0.1 in a background thread.
- `KVIndexerProcess`: `kvatlas indexer …` as a real subprocess (for kill -9 tests).
- `WorkerSim`: a worker's tiered cache as a plain model: it emits the KV events an engine would
  (SGLang page hashes, GPU stores, host offloads, evictions) and answers what `/score` must say.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import httpx

from router_api.procs import spawn
from support.net import free_port, wait_until
from producer.page_hash import page_ids
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

REPO = Path(__file__).resolve().parent.parent


class LiveIndexer:
    """In-process service + uvicorn. `stop(hard=True)` skips the final snapshot (like a crash)."""

    def __init__(self, config: Any, *, subscriber_factory: Callable[[], Any] | None = None,
                 index: Any | None = None) -> None:
        import uvicorn

        from router.decision import PolicyChooser
        from router_api.app import create_app
        from router_api.service import IndexerService

        self.service = IndexerService(config, subscriber_factory=subscriber_factory, index=index)
        self.app = create_app(self.service, chooser=PolicyChooser())
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, host="127.0.0.1", port=config.port, log_level="warning", access_log=False,
            lifespan="off"))
        self.url = f"http://127.0.0.1:{config.port}"
        self._thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)
        headers = {"Authorization": f"Bearer {config.auth_token}"} if config.auth_token else {}
        self.client = httpx.Client(base_url=self.url, timeout=10.0, headers=headers)

    def start(self) -> "LiveIndexer":
        self.service.start()
        self._thread.start()
        wait_until(lambda: self.server.started, timeout=10)
        return self

    def stop(self, hard: bool = False) -> None:
        self.client.close()
        self.server.should_exit = True
        self._thread.join(10)
        self.service.stop(final_snapshot=not hard)

    def __enter__(self) -> "LiveIndexer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class KVIndexerProcess:
    """`kvatlas indexer` as a child process, killed with SIGKILL (no final snapshot) or SIGTERM."""

    def __init__(self, port: int, *extra: str, log_path: Path) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = spawn(
            [sys.executable, "-m", "cli.main", "indexer", "--port", str(port), *extra],
            cwd=str(REPO), stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.client = httpx.Client(base_url=self.url, timeout=10.0)

    def wait_ready(self, timeout: float = 30.0) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"indexer exited early:\n{self.log_path.read_text()[-3000:]}")
            try:
                return self.client.get("/health").status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(up, timeout=timeout, interval=0.02)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.client.close()
        self._log.close()

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(20)
        self.client.close()
        self._log.close()
        return rc


# --- a worker's cache, as a reference model ------------------------------------------------------

class _Block:
    __slots__ = ("parent", "tokens", "tiers", "children")

    def __init__(self, parent: int | None, tokens: list[int]) -> None:
        self.parent = parent
        self.tokens = tokens
        self.tiers: set[str] = set()
        self.children: set[int] = set()


class WorkerSim:
    """One worker's GPU + host cache. `step()` returns the events of one scheduler step;
    `expect(tokens)` what an exact indexer must report for this worker."""

    def __init__(self, seed: int, block_size: int, prompts: list[list[int]]) -> None:
        self.rng = random.Random(seed)
        self.bs = block_size
        self.prompts = prompts
        self.blocks: dict[int, _Block] = {}
        self.history: list[list[int]] = []

    def _present(self, h: int) -> bool:
        b = self.blocks.get(h)
        return b is not None and bool(b.tiers)

    def request_tokens(self) -> list[int]:
        rng = self.rng
        if self.history and rng.random() < 0.3:
            base = rng.choice(self.history)  # a follow-up turn extends an earlier request
        else:
            base = list(rng.choice(self.prompts))
        return base + [rng.randrange(1, 50_000) for _ in range(self.bs * rng.randint(1, 4))]

    def store(self, tokens: list[int]) -> list[KVEvent]:
        bs = self.bs
        ids = [h & ((1 << 64) - 1) for h in page_ids(tokens, bs)]
        first = next((i for i, h in enumerate(ids) if not (self._present(h) and "GPU" in self.blocks[h].tiers)),
                     None)
        if first is None:
            return []
        parent = ids[first - 1] if first else None
        for i in range(first, len(ids)):
            h = ids[i]
            b = self.blocks.get(h)
            if b is None:
                b = self.blocks[h] = _Block(ids[i - 1] if i else None, tokens[i * bs:(i + 1) * bs])
                if b.parent is not None:
                    self.blocks[b.parent].children.add(h)
            b.tiers.add("GPU")
        self.history.append(tokens[: len(ids) * bs])
        if len(self.history) > 64:
            self.history.pop(0)
        return [BlockStored(block_hashes=ids[first:], parent_block_hash=parent,
                            token_ids=tokens[first * bs: len(ids) * bs], block_size=bs, medium="GPU")]

    def offload(self) -> list[KVEvent]:
        """A GPU leaf is written to host (ack'd), then freed on the device."""
        cands = [h for h, b in self.blocks.items() if "GPU" in b.tiers
                 and not any("GPU" in self.blocks[c].tiers for c in b.children)]
        if not cands:
            return []
        h = self.rng.choice(sorted(cands))
        b = self.blocks[h]
        out: list[KVEvent] = []
        if "CPU_PINNED" not in b.tiers:
            out.append(BlockStored(block_hashes=[h], parent_block_hash=b.parent, token_ids=b.tokens,
                                   block_size=self.bs, medium="CPU_PINNED"))
            b.tiers.add("CPU_PINNED")
        out.append(BlockRemoved(block_hashes=[h], medium="GPU"))
        b.tiers.discard("GPU")
        return out

    def evict(self) -> list[KVEvent]:
        cands = [h for h, b in self.blocks.items() if b.tiers and not any(self._present(c) for c in b.children)]
        if not cands:
            return []
        h = self.rng.choice(sorted(cands))
        b = self.blocks.pop(h)
        if b.parent is not None and b.parent in self.blocks:
            self.blocks[b.parent].children.discard(h)
        return [BlockRemoved(block_hashes=[h], medium=m) for m in sorted(b.tiers)]

    def step(self) -> list[KVEvent]:
        r = self.rng.random()
        if r < 0.55 or len(self.blocks) < 8:
            return self.store(self.request_tokens())
        if r < 0.8:
            return self.offload()
        return self.evict()

    def clear(self) -> None:
        self.blocks.clear()
        self.history.clear()

    def snapshot(self) -> list[KVEvent]:
        """The answer a kvatlas producer publishes to a snapshot request (a resync, docs/service.md):
        AllBlocksCleared, then a store per (block, tier), parents before children."""
        out: list[KVEvent] = [AllBlocksCleared()]
        todo = sorted(h for h, b in self.blocks.items() if b.parent is None or b.parent not in self.blocks)
        while todo:
            h = todo.pop()
            b = self.blocks[h]
            for m in sorted(b.tiers):
                out.append(BlockStored(block_hashes=[h], parent_block_hash=b.parent, token_ids=b.tokens,
                                       block_size=self.bs, medium=m))
            todo.extend(sorted(c for c in b.children if c in self.blocks))
        return out

    def expect(self, tokens: list[int]) -> dict[str, Any]:
        ids = [h & ((1 << 64) - 1) for h in page_ids(tokens, self.bs)]
        device = cached = 0
        tiers = {"gpu": 0, "host": 0, "disk": 0, "shared": 0}
        on_device = True
        for h in ids:
            b = self.blocks.get(h)
            if b is None or not b.tiers:
                break
            if on_device and "GPU" in b.tiers:
                device += 1
            else:
                on_device = False
            cached += 1
            tiers["gpu" if "GPU" in b.tiers else "host"] += 1
        return {"device_blocks": device, "cached_blocks": cached, "tiers": tiers}

    def sample_queries(self, n: int) -> list[list[int]]:
        """Queries that hit this worker's cache at varied depths, plus misses."""
        out = []
        for _ in range(n):
            if self.history and self.rng.random() < 0.8:
                base = self.rng.choice(self.history)
                cut = self.rng.randint(1, len(base) // self.bs) * self.bs
                out.append(base[:cut] + [self.rng.randrange(1, 50_000) for _ in range(self.rng.randint(0, 2 * self.bs))])
            else:
                out.append([self.rng.randrange(1, 50_000) for _ in range(self.bs * 3)])
        return out


def make_prompts(seed: int, block_size: int, n: int = 6, blocks: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 50_000) for _ in range(block_size * blocks)] for _ in range(n)]


def score(client: httpx.Client, tokens: list[int], **kw: Any) -> dict[str, Any]:
    r = client.post("/score", json={"token_ids": tokens, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def check_scores(client: httpx.Client, sims: dict[str, WorkerSim], queries: list[list[int]]) -> int:
    """Assert /score equals every simulated worker's expectation; returns queries checked."""
    for q in queries:
        body = score(client, q)
        got = {w["worker_id"]: w for w in body["workers"]}
        assert set(got) == set(sims), (sorted(got), sorted(sims))
        for wid, sim in sims.items():
            exp = sim.expect(q)
            g = got[wid]
            assert (g["device_blocks"], g["cached_blocks"], g["tiers"]) == (
                exp["device_blocks"], exp["cached_blocks"], exp["tiers"]), (wid, g, exp)
    return len(queries)


def wait_applied(client: httpx.Client, marks: dict[str, int], timeout: float = 20.0,
                 pubs: dict[str, Any] | None = None) -> None:
    """Poll /workers until every worker's last_seq reached the given seq. `pubs` (worker -> publisher)
    get a heartbeat on each probe, as our producer sends them: a subscriber that connected after a
    batch was sent (PUB drops for absent peers) learns of it from the next message and replays."""
    def done() -> bool:
        rows = {w["worker_id"]: w for w in client.get("/workers").json()["workers"]}
        ok = True
        for wid, s in marks.items():
            seq = rows.get(wid, {}).get("last_seq")
            if seq is None or seq < s:
                ok = False
                if pubs and wid in pubs:
                    pubs[wid].heartbeat()
        return ok
    wait_until(done, timeout=timeout, interval=0.05)


def dump_state(dump: dict[str, Any], model: str = "default") -> dict[tuple[str, int], dict[Any, set[str]]]:
    """/dump JSON -> per (worker, dp_rank), engine hash -> tiers it is held on (order-free)."""
    out: dict[tuple[str, int], dict[Any, set[str]]] = {}
    for entry in dump["models"][model]["workers"]:
        held = out.setdefault((entry["worker_id"], entry["dp_rank"]), {})
        for ev in entry["events"]:
            if ev["type"] == "BlockStored":
                for h in ev["block_hashes"]:
                    held.setdefault(h, set()).add(ev.get("medium") or "GPU")
            elif ev["type"] == "BlockRemoved":
                for h in ev["block_hashes"]:
                    held.get(h, set()).discard(ev.get("medium") or "GPU")
    return out


@contextmanager
def service_with_publisher(block_size: int) -> Iterator[tuple[object, object]]:
    """A started `IndexerService` (no HTTP) and a real ZmqEventPublisher registered to it as "w0",
    once the subscription delivers; both closed afterwards. Yields (service, publisher)."""
    from producer.publisher import ZmqEventPublisher
    from router_api.config import ServiceConfig
    from router_api.service import IndexerService
    from schemas.api import RegisterWorker

    svc = IndexerService(ServiceConfig(port=0, block_size=block_size, stale_after_s=600, remove_after_s=3600))
    svc.start()
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    try:
        svc.register(RegisterWorker(worker_id="w0", endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint,
                                    block_size=block_size))
        wait_until(lambda: (pub.heartbeat(), svc.registry.get("w0").last_seq is not None)[1], timeout=10)
        yield svc, pub
    finally:
        pub.close()
        svc.stop(final_snapshot=False)


@contextmanager
def indexer_with_publishers(config: Any, worker_ids: list[str], block_size: int) -> Iterator[LiveIndexer]:
    """A started `LiveIndexer` with one real ZmqEventPublisher (and replay endpoint) registered over
    HTTP per worker id; every publisher and the indexer closed afterwards."""
    from producer.publisher import ZmqEventPublisher

    li = LiveIndexer(config).start()
    pubs = []
    try:
        for wid in worker_ids:
            pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
            pubs.append(pub)
            r = li.client.post("/workers", json={"worker_id": wid, "endpoint": pub.endpoint,
                                                  "replay_endpoint": pub.replay_endpoint, "block_size": block_size})
            assert r.status_code == 201, r.text
        yield li
    finally:
        for p in pubs:
            p.close()
        li.stop()


def publishing_driver(pub: Any, requests: int, seed: int, page_size: int = 4) -> tuple[Any, Any, list[list[int]]]:
    """A small tiered cache whose events go out through `pub` (a ZmqEventPublisher), its Driver, and a
    shuffled synthetic request stream of shared prefixes: (cache, driver, requests)."""
    from producer.events import EventRecorder
    from producer.sinks import ZmqSink
    from sim.driver import Driver, StreamSpec, build_cache, synthetic_stream

    cache = build_cache(page_size=page_size, device_pages=40, host_pages=120, transfer="thread",
                        recorder=EventRecorder(ZmqSink(pub), heartbeat_interval_s=3600.0))
    reqs = list(synthetic_stream(StreamSpec(requests=requests, prefixes=6, prefix_tokens=48, suffix_tokens=12,
                                            seed=seed)))
    random.Random(seed).shuffle(reqs)
    return cache, Driver(cache, lookahead=0), reqs


def snapshot_marks(path: Path) -> dict[str, int]:
    """Per worker, the seq watermark a snapshot file holds ({} before the first snapshot)."""
    from indexer.snapshot import decode_snapshot, make_snapshot_store

    store = make_snapshot_store(str(path))
    assert store is not None
    data = store.load()
    store.close()
    if data is None:
        return {}
    return {w.reg.worker_id: w.last_seq for w in decode_snapshot(data).workers if w.last_seq is not None}


def serve_both_fronts(app: Any) -> dict[str, tuple[Any, Any, int]]:
    """The indexer app on two in-process uvicorn servers: "fast" (the protocol fast path) and "asgi"
    (plain uvicorn), each on its own port and thread, started: name -> (server, thread, port)."""
    import threading

    import uvicorn

    from cli.indexer import server_settings

    servers: dict[str, tuple[Any, Any, int]] = {}
    for name, fast in (("fast", True), ("asgi", False)):
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, **server_settings("127.0.0.1", port, fast)))
        t = threading.Thread(target=server.run, name=f"uvicorn-{name}", daemon=True)
        t.start()
        servers[name] = (server, t, port)
    for server, _t, _p in servers.values():
        wait_until(lambda s=server: s.started, timeout=20)
    return servers
