"""The OpenAI router's data-plane cost (docs/openai.md, "Cost per request"), every figure against
peers measured in the same run: the same requests sent straight to the worker, through a minimal
pass-through on the router's own stack (uvicorn + httptools + httpx, no tokenizing, no indexer: the
stack's floor), through a minimal aiohttp + uvloop pass-through (the issue's reference floor), and through `kvatlas router --api openai` with `round_robin` (tokenizes, one
`/routes/decide` carrying the router's choice) and `precise_tiered` (the indexer chooses).

Per target: added p50 / p99 latency over direct (ms), router CPU per request (its process's user +
system time over the requests it served) and the indexer's, requests/s; at concurrency 16, short chats (a shared
system prompt plus a short question) streamed and not, and long chats (~26k tokens) not streamed.

    python -m bench.bench_router [--quick] [--concurrency 16] [--requests 800]

Real processes on loopback (the README's fleet: an indexer, two `kvatlas worker`s with a near-instant
simulated model, routers over both; direct calls and the pass-through go to the first). The load generator shares the machine's cores with them: compare ratios within a run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from router.demo.procs import Child, free_port, kvatlas_cmd, wait_healthy

TOK_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "tiny-chat"
WORDS = ("the cache holds key and value blocks for every token of the prompt routing a request to the worker "
         "that already holds its prefix saves prefill time answer briefly and precisely").split()
TICK = os.sysconf("SC_CLK_TCK")
PROFILED = ("import cProfile, signal, sys, runpy; p = cProfile.Profile(__import__('time').process_time); "
            "signal.signal(signal.SIGUSR1, lambda *a: p.dump_stats({out!r})); sys.argv[0] = 'kvatlas'; "
            "p.enable(); runpy.run_module('cli.main', run_name='__main__')")


def cpu_s(pid: int) -> float:
    """User + system seconds of a process so far (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def passthrough_main(port: int, upstream: str) -> None:
    """The floor: uvicorn + httpx forwarding the body as is (no tokenizer, no indexer, no policy)."""
    import uvicorn
    from starlette.responses import StreamingResponse

    client = httpx.AsyncClient(base_url=upstream, timeout=60.0,
                               limits=httpx.Limits(max_connections=256, keepalive_expiry=2.0))

    async def app(scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        if scope["method"] == "GET":
            r = await client.get(scope["path"])
            await StreamingResponse(iter([r.content]), status_code=r.status_code)(scope, receive, send)
            return
        req = client.build_request("POST", scope["path"], content=body, headers={"content-type": "application/json"})
        resp = await client.send(req, stream=True)

        async def relay():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        await StreamingResponse(relay(), status_code=resp.status_code,
                                media_type=resp.headers.get("content-type"))(scope, receive, send)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off",
                http="httptools", loop="uvloop")


def aiohttp_passthrough_main(port: int, upstream: str) -> None:
    """The issue's reference floor: aiohttp + uvloop relaying the body and the answer's chunks as they
    come (no tokenizer, no indexer, no policy)."""
    import aiohttp
    import uvloop
    from aiohttp import web

    async def make() -> web.Application:
        session = aiohttp.ClientSession(upstream, connector=aiohttp.TCPConnector(limit=256))

        async def relay(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            async with session.request(request.method, request.path, data=body,
                                       headers={"content-type": "application/json"}) as up:
                out = web.StreamResponse(status=up.status)
                out.content_type = up.content_type
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", relay)
        app.on_cleanup.append(lambda _: session.close())
        return app

    uvloop.install()
    web.run_app(make(), host="127.0.0.1", port=port, print=None, access_log=None)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def load(url: str, bodies: list[dict], concurrency: int) -> tuple[list[float], float]:
    """(latencies, wall seconds) of all bodies sent with `concurrency` in flight."""
    lat: list[float] = []
    queue = list(reversed(bodies))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits) as c:
        async def one_client() -> None:
            while queue:
                b = queue.pop()
                t0 = time.perf_counter()
                if b.get("stream"):
                    async with c.stream("POST", "/v1/chat/completions", json=b) as r:
                        async for _ in r.aiter_raw():
                            pass
                        assert r.status_code == 200
                else:
                    r = await c.post("/v1/chat/completions", json=b)
                    assert r.status_code == 200, r.text[:200]
                lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        return lat, time.perf_counter() - t0


Row = tuple[float, float, float, "float | None", float]  # p50, p99, req/s, cpu/request, indexer cpu/request


def measure(targets: dict[str, tuple[str, int | None]], bodies: list[dict], concurrency: int, label: str,
            indexer_pid: int) -> dict[str, Row]:
    """One table: per target, latency, requests/s, its own process's CPU per request and the
    indexer's (its `/routes/decide` and `/routes/admitted` calls; only routers call it)."""
    for url, _ in targets.values():  # warm connections and caches
        asyncio.run(load(url, bodies[: 2 * concurrency], concurrency))
    rows: dict[str, Row] = {}
    for name, (url, pid) in targets.items():
        c0, i0 = (cpu_s(pid) if pid else 0.0), cpu_s(indexer_pid)
        lat, wall = asyncio.run(load(url, bodies, concurrency))
        cpu = (cpu_s(pid) - c0) / len(bodies) if pid else None
        icpu = (cpu_s(indexer_pid) - i0) / len(bodies)
        lat.sort()
        rows[name] = (statistics.median(lat), lat[int(0.99 * (len(lat) - 1))], len(lat) / wall, cpu, icpu)
    d50, d99 = rows["direct"][0], rows["direct"][1]
    print(f"\n{label}: {len(bodies)} requests, concurrency {concurrency}")
    print(f"  {'target':<26} {'p50 ms':>8} {'+p50 ms':>8} {'p99 ms':>8} {'+p99 ms':>8} {'req/s':>8} {'cpu ms/req':>11}"
          f" {'indexer cpu':>11}")
    for name, (p50, p99, rps, cpu, icpu) in rows.items():
        print(f"  {name:<26} {1e3 * p50:8.2f} {1e3 * (p50 - d50):8.2f} {1e3 * p99:8.2f} {1e3 * (p99 - d99):8.2f} "
              f"{rps:8.0f} {'' if cpu is None else f'{1e3 * cpu:11.3f}'} {1e3 * icpu:11.3f}")
    return rows


def spread(label: str, runs: list[dict[str, Row]]) -> None:
    """Per target over the runs: router CPU per request and added p50, min..max (median)."""
    print(f"\n{label}: {len(runs)} runs, min..max (median)")
    for name in runs[0]:
        if name == "direct":
            continue
        cpu = [1e3 * r[name][3] for r in runs if r[name][3] is not None]
        add = [1e3 * (r[name][0] - r["direct"][0]) for r in runs]
        add99 = [1e3 * (r[name][1] - r["direct"][1]) for r in runs]
        print(f"  {name:<26} cpu ms/req {min(cpu):.3f}..{max(cpu):.3f} ({statistics.median(cpu):.3f})   "
              f"+p50 ms {min(add):.2f}..{max(add):.2f} ({statistics.median(add):.2f})   "
              f"+p99 ms {min(add99):.2f}..{max(add99):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--runs", type=int, default=1, help="repeat the short-chat tables (spread printed)")
    ap.add_argument("--no-long", action="store_true", help="skip the long-chat table")
    ap.add_argument("--base-tree", default=None, metavar="DIR",
                    help="also run precise_tiered from this source tree (e.g. a `git archive` of an older commit "
                         "with the native modules copied in), as a peer in the same run")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="run the routers under cProfile, writing DIR/<router>.prof when they stop")
    ap.add_argument("--passthrough", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    ap.add_argument("--aiohttp-passthrough", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.passthrough:
        passthrough_main(int(a.passthrough[0]), a.passthrough[1])
        return
    if a.aiohttp_passthrough:
        aiohttp_passthrough_main(int(a.aiohttp_passthrough[0]), a.aiohttp_passthrough[1])
        return
    n = 160 if a.quick else a.requests
    with tempfile.TemporaryDirectory(prefix="kvatlas-bench-router-") as tmpd:
        tmp = Path(tmpd)
        ip, wp, wp1, pp, ap_port, rr, rp = (free_port() for _ in range(7))
        kids: list[Child] = []
        routers: dict[str, tuple[str, int]] = {}
        try:
            idx = Child("indexer", kvatlas_cmd("indexer", "--port", str(ip)), tmp)
            kids.append(idx)
            wait_healthy([(idx, f"http://127.0.0.1:{ip}")])
            w, w1 = (Child(wid, kvatlas_cmd("worker", "--id", wid, "--port", str(port), "--indexer",
                                            f"http://127.0.0.1:{ip}", "--tokenizer", str(TOK_DIR), "--speed",
                                            "100000", "--gpu-pages", "4096"), tmp)
                     for wid, port in (("w0", wp), ("w1", wp1)))
            kids += [w, w1]
            wait_healthy([(w, f"http://127.0.0.1:{wp}"), (w1, f"http://127.0.0.1:{wp1}")])
            wurl = f"http://127.0.0.1:{wp}"
            pt = Child("passthrough", [sys.executable, "-m", "bench.bench_router", "--passthrough", str(pp), wurl], tmp)
            apt = Child("aiohttp-passthrough", [sys.executable, "-m", "bench.bench_router", "--aiohttp-passthrough",
                                                str(ap_port), wurl], tmp)
            kids += [pt, apt]
            plan = [("router round_robin", rr, "round_robin", None), ("router precise_tiered", rp, "precise_tiered", None)]
            if a.base_tree:
                plan.append(("base precise_tiered", free_port(), "precise_tiered", a.base_tree))
            for name, port, policy, tree in plan:
                argv = kvatlas_cmd(
                    "router", "--port", str(port), "--indexer", f"http://127.0.0.1:{ip}", "--tokenizer", str(TOK_DIR),
                    "--worker", f"w0={wurl}", "--worker", f"w1=http://127.0.0.1:{wp1}", "--policy", policy)
                if a.profile:  # under cProfile: SIGUSR1 writes the file (sent before the routers stop)
                    out = Path(a.profile) / f"{name.replace(' ', '-')}.prof"
                    argv[1:3] = ["-c", PROFILED.format(out=str(out))]
                if tree:  # its own modules first: run from that tree
                    argv = ["sh", "-c", 'cd "$0" && exec "$@"', tree, *argv]
                ch = Child(name.replace(" ", "-"), argv, tmp)
                kids.append(ch)
                routers[name] = (f"http://127.0.0.1:{port}", ch.proc.pid)
                wait_healthy([(ch, f"http://127.0.0.1:{port}")])
            wait_healthy([(pt, f"http://127.0.0.1:{pp}"), (apt, f"http://127.0.0.1:{ap_port}")])
            targets = {"direct": (wurl, w.proc.pid), "pass-through (floor)": (f"http://127.0.0.1:{pp}", pt.proc.pid),
                       "aiohttp pass-through": (f"http://127.0.0.1:{ap_port}", apt.proc.pid), **routers}
            rng = random.Random(2)
            system = {"role": "system", "content": words(rng, 120)}
            short = [{"model": "default", "max_tokens": 1,
                      "messages": [system, {"role": "user", "content": words(rng, 12)}]} for _ in range(n)]
            streamed = [{**b, "stream": True, "max_tokens": 4} for b in short]
            plain_runs, stream_runs = [], []
            for i in range(a.runs):
                run = f" (run {i + 1}/{a.runs})" if a.runs > 1 else ""
                plain_runs.append(measure(targets, short, a.concurrency, "short chats (~300 tokens), not streamed"
                                          + run, idx.proc.pid))
                stream_runs.append(measure(targets, streamed, a.concurrency, "short chats, streamed (4 tokens)" + run,
                                           idx.proc.pid))
            if a.runs > 1:
                spread("short chats, not streamed", plain_runs)
                spread("short chats, streamed", stream_runs)
            if a.no_long:
                return
            long_system = {"role": "system", "content": words(rng, 2400 if a.quick else 6000)}
            longs = [{"model": "default", "max_tokens": 1,
                      "messages": [long_system, {"role": "user", "content": words(rng, 12)}]}
                     for _ in range(max(32, n // 10))]
            measure(targets, longs, min(a.concurrency, 4), "long chats (shared system prompt), not streamed",
                    idx.proc.pid)
        finally:
            if a.profile:
                for name, (_, pid) in routers.items():
                    os.kill(pid, signal.SIGUSR1)
                time.sleep(2.0)  # the dump is written by the router's signal handler: give it time
            for k in reversed(kids):
                k.stop()


if __name__ == "__main__":
    main()
