"""Indexer service benchmark: kvatlas `kvatlas indexer` vs Dynamo's standalone indexer
(`python -m dynamo.indexer`, ai-dynamo-runtime==1.6.1 from .venv-bench), same run, same event
stream, same queries. Both run as subprocesses fed by real ZMQ publishers; printed figures are
ratios kvatlas / Dynamo (lower is better for latency and memory, higher for ingestion).

  bash bench/setup_bench_env.sh        # once: creates .venv-bench with ai-dynamo-runtime
  .venv/bin/python -m bench.bench_service [--runs 2] [--streams shared,unshared] [--shapes map,array] [--dynamo-threads 4]

Defaults are issue 25's comparison: kvatlas with no flags against Dynamo `--threads 4`, 32 publishers,
once per stream and event shape. Streams (`service_stream.KINDS`): `shared` (294k stored blocks per
stream; requests share 16 system prompts across the fleet) and `unshared` (576k stored, 513k resident
(worker, block) entries: every request the worker's own, one in eight evicted again four requests
later, so nearly every node has one holder). Shapes: `map` (SGLang / vLLM 0.33 tagged maps), `array`
(vLLM's array-like tagged events, same content). `--runs 2` alternates them run by run and ends with a
table of the ratios per run, stream and shape against the targets. Every timed answer (and a sample of
shared-prompt queries) of both services is checked against the truth the streams define; a mismatch
exits 1. Dynamo's WARN / ERROR log lines (an event it dropped or could not parse) are counted and shown.

Measured (ingestion figures are the median of `--reps` fresh service pairs, the order alternating):
- ingestion, live: blocks/s from the first send until the last block of every worker is visible via
  a query (one service at a time, the other idle). Both are fed by the same sender: a PUB endpoint
  per worker that speaks ZMTP itself (`bench/support/zmtp_pub.py`; a replay socket the bench answers
  itself), every message encoded before the clock starts and 32 of a worker's messages written per
  `sendall`, round the fleet, into a send buffer that holds the stream — the whole stream leaves in
  ~0.01-0.02 s, so the figure is the service's ingest rate, not the sender's (a pyzmq PUB loop took
  ~0.2 s for it on this box and set the figure for both services until 2026-11-25);
- ingestion, backlog: the service is stopped (SIGSTOP), a second stream is sent, then it resumes
  (SIGCONT): blocks/s from resuming until the last block is visible — the service's own drain
  rate, with no sender in the interval;
- `/score` (JSON; msgpack; raw u32 bodies with msgpack answers) vs Dynamo `/query` (JSON): p50/p99
  at 1k / 8k / 32k tokens, sequential keep-alive requests, prefixes that hit; request bodies are
  encoded before the clock starts (both services), so the client's encoder is not measured, and the
  client is a minimal HTTP/1.1 one (`LeanHttp`, ~0.01 ms a request) rather than http.client (~0.07
  ms of the client's own Python per request, which had been part of every figure; `--client
  http.client` measures with it); both
  services are up during this phase and requests alternate between them one by one, in a fresh
  random order each round (in a fixed order kvatlas' JSON request always came right after one of
  Dynamo's, and Dynamo's right after its own /health: on 2 shared cores the slot a request runs in
  moved its p50 by more than the services differ at 1k), so load from
  elsewhere on a shared host hits both series alike;
- the HTTP floor: `GET /health` p50/p99, interleaved with the queries above;
- embedded mode (`router_api.embedded.EmbeddedIndexer` in the bench's own process, subscribed to the
  same publishers after the HTTP phase): its `score` and the index lookup alone, p50 per size;
- with `--asgi-peer`: a second kvatlas with `--http-fast-path off` (uvicorn's ASGI path through the
  front) timed in the same interleaved loop, printed as asgi / fast-path ratios;
- ingestion CPU: the service process's CPU seconds (all threads) over the live interval, per block;
- RSS per indexed block: (RSS after ingestion - RSS before) / blocks stored, at visibility and 1 s later;
  RSS per resident entry: the same growth / the (worker, block) entries the stream leaves resident
  (issue 33's measure: the target is on this one, on both streams).
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parent.parent

from producer.page_hash import page_ids  # noqa: E402
from schemas.codec import encode_batch  # noqa: E402
from schemas.events import BlockStored, KVEventBatch  # noqa: E402
from bench.support.service_report import SIZES, ratios, report, summary  # noqa: E402
from bench.support.service_stream import BS, KINDS, SHAPES, RawPublisher, Stream, chunked, group_events, send_chunks, send_interleaved  # noqa: E402
from bench.support.service_procs import CLIENT, CLIENTS, Dynamo, Embedded, Kvatlas, Service, cpu_s, rss_kib, wait_for  # noqa: E402


# --- one measured run ---------------------------------------------------------------------------

def connect(svc: Any, ctx: zmq.Context | None, n: int, pubs: list[RawPublisher] | None = None,
            hybrid: bool = False) -> list[RawPublisher]:
    """Register `n` publishers (new ones, or `pubs` already streaming: the subscriber then replays
    their history from seq 0) and wait until each has delivered a probe block."""
    if pubs is None:
        assert ctx is not None
        pubs = [RawPublisher(ctx) for _ in range(n)]
    for i, p in enumerate(pubs):
        svc.register(i, p.endpoint, p.replay_endpoint)
    # A probe block per worker, re-sent until visible (PUB drops before SUB connects).
    probe = [7] * BS
    probe_ev = encode_batch(KVEventBatch(time.time(), group_events(
        BlockStored, hybrid, block_hashes=page_ids(probe, BS), parent_block_hash=None, token_ids=probe, block_size=BS,
        medium="GPU")))

    def all_probed() -> bool:
        for p in pubs:
            p.serve_replay()
        m = svc.matched(probe)
        if len(m) == len(pubs) and all(v >= 1 for v in m.values()):
            return True
        for p in pubs:
            p.send(p.frames([probe_ev])[0], [probe_ev])
        return False
    wait_for(all_probed, 60, f"{svc.name} subscriptions", interval=0.05)
    return pubs


def wait_visible(svc: Any, stream: Stream, pubs: list[RawPublisher]) -> float:
    """The time the last worker's marker chain was seen. Each worker is queried until its marker is
    visible, then no more (markers are never removed), so the figure ends with the query that saw
    the last one — not with a confirming sweep over the fleet (32 sequential queries, ~5 ms of the
    bench client's time, were part of both services' figures until 2026-11-25)."""
    pending = list(range(len(stream.markers)))
    seen = [0.0]

    def visible() -> bool:
        for p in pubs:
            p.serve_replay()  # (nothing is lost with an unbounded pipe; answered all the same)
        while pending:
            i = pending[0]
            mk = stream.markers[i]
            if svc.matched(mk).get(f"w{i}", 0) < len(mk) // BS:
                return False
            seen[0] = time.perf_counter()
            pending.pop(0)
        return True
    # 2 ms between probes: finer than the 5 (earlier 20) ms the figure was quantised to, one cheap
    # query each for both services.
    wait_for(visible, 600, f"{svc.name} ingestion", interval=0.002)
    return seen[0]


def ingest(svc: Service, stream: Stream, backlog: Stream, ctx: zmq.Context) -> tuple[dict[str, Any], list[RawPublisher]]:
    """Live run of `stream`, then a backlog run of `backlog`; returns the figures and the publishers."""
    pubs = connect(svc, ctx, len(stream.payloads), hybrid=stream.hybrid)
    rss0 = rss_kib(svc.proc.pid)
    cpu0 = cpu_s(svc.proc.pid)
    plan = chunked(pubs, stream.payloads)
    t0 = time.perf_counter()
    send_chunks(plan)
    t_sent = time.perf_counter()
    t1 = wait_visible(svc, stream, pubs)
    cpu1 = cpu_s(svc.proc.pid)
    rss1 = rss_kib(svc.proc.pid)
    # Settled: what the process keeps once the burst's buffers are released (same wait for both).
    wait_for(lambda: time.perf_counter() - t1 >= 1.0, 5, "settle", interval=0.05)
    rss2 = rss_kib(svc.proc.pid)

    # Backlog: everything is queued while the service is stopped; only its drain is timed.
    os.kill(svc.proc.pid, signal.SIGSTOP)
    try:
        send_interleaved(pubs, backlog.payloads)
        # Let the pipes fill (ZMQ's I/O thread moves the bytes) before the service resumes.
        wait_for(lambda: time.perf_counter() - t1 >= 1.5, 5, "backlog queued", interval=0.05)
    finally:
        tb0 = time.perf_counter()
        os.kill(svc.proc.pid, signal.SIGCONT)
    tb1 = wait_visible(svc, backlog, pubs)
    return ({"blocks": stream.blocks, "ingest_s": t1 - t0, "blocks_per_s": stream.blocks / (t1 - t0),
             "send_s": t_sent - t0, "cpu_us_per_block": (cpu1 - cpu0) * 1e6 / stream.blocks,
             "backlog_blocks_per_s": backlog.blocks / (tb1 - tb0),
             "rss_per_block_b": (rss1 - rss0) * 1024 / stream.blocks,
             "rss_settled_per_block_b": (rss2 - rss0) * 1024 / stream.blocks,
             "rss_per_entry_b": (rss1 - rss0) * 1024 / stream.entries,
             "rss_settled_per_entry_b": (rss2 - rss0) * 1024 / stream.entries}, pubs)


def query_docs(stream: Stream, size: int, n_queries: int, rng: random.Random) -> list[list[int]]:
    """The timed queries of one size: prefixes of stored documents (one worker holds each whole)."""
    return [stream.docs[rng.randrange(len(stream.docs))][:size] for _ in range(n_queries)]


def truth(streams: list[Stream], tokens: list[int]) -> dict[str, int]:
    """Per worker, the query's leading blocks it stored (every stream sent to it, and the probe):
    what an exact index answers (workers with none left out)."""
    ids = page_ids(tokens, BS)
    probe = page_ids([7] * BS, BS)[0]
    out = {}
    for w in range(len(streams[0].stored)):
        n = 0
        for h in ids:
            if h != probe and not any(h in s.stored[w] for s in streams):
                break
            n += 1
        if n:
            out[f"w{w}"] = n
    return out


def latencies(svcs: list[Service], stream: Stream, n_queries: int,
              answers: dict[str, dict[str, dict[int, list[bytes]]]] | None = None
              ) -> dict[str, dict[str, dict[int, list[float]]]]:
    """Per service, body format and size: request latencies (and, into `answers`, every timed answer's
    bytes, checked after the clock). Requests to the services (and formats) are interleaved one by
    one, so a noisy neighbour on a shared host slows every series alike."""
    rng = random.Random(1)
    out: dict[str, dict[str, dict[int, list[float]]]] = {svc.name: {} for svc in svcs}
    for size in SIZES:
        docs = query_docs(stream, size, n_queries, rng)
        series = []
        for svc in svcs:
            for fmt, (encode, fn) in svc.queries().items():
                if fmt == "health" and size != SIZES[0]:
                    continue  # the HTTP floor: once is enough
                # Bodies are encoded before timing: the figures are the service's, not the client's encoder.
                series.append((svc.name, fmt, fn, [encode(d) for d in docs]))
        for name, fmt, fn, bodies in series:
            for b in bodies[:10]:
                fn(b)  # warm-up
            out[name].setdefault(fmt, {})[size] = []
        got = {(name, fmt): [] for name, fmt, _, _ in series}
        order = random.Random(size)
        for i in range(n_queries):
            # A fresh order each round: a request that always followed the other service's (Dynamo's
            # runtime threads spin a while after answering, on the same 2 cores) paid for it in every
            # sample, and one that followed its own service's ran warm (module doc).
            order.shuffle(series)
            for name, fmt, fn, bodies in series:
                a = time.perf_counter()
                ans = fn(bodies[i])
                out[name][fmt][size].append(time.perf_counter() - a)
                got[name, fmt].append(ans)
        if answers is not None:
            for (name, fmt), bs in got.items():
                answers.setdefault(name, {}).setdefault(fmt, {})[size] = bs
    return out


def check_answers(svcs: list[Service], streams: list[Stream], n_queries: int,
                  answers: dict[str, dict[str, dict[int, list[bytes]]]]) -> tuple[int, list[str]]:
    """Every timed answer (and one query per sampled request prompt, shared prompts hitting many
    workers) against the truth from the streams: (answers checked, the first few mismatches)."""
    rng = random.Random(1)
    checked, bad = 0, []
    for size in SIZES:
        want = [truth(streams, d) for d in query_docs(streams[0], size, n_queries, rng)]
        for svc in svcs:
            for fmt, bodies in answers.get(svc.name, {}).items():
                if fmt == "health":
                    continue
                for i, b in enumerate(bodies[size]):
                    checked += 1
                    got = {k: v for k, v in svc.decode(fmt, b).items() if v}
                    if got != want[i] and len(bad) < 5:
                        bad.append(f"{svc.name} {fmt} {size} #{i}: {got} != {want[i]}")
    for toks in streams[0].requests:
        want_r = truth(streams, toks)
        for svc in svcs:
            checked += 1
            got = {k: v for k, v in svc.matched(toks).items() if v}
            if got != want_r and len(bad) < 5:
                bad.append(f"{svc.name} request prompt: {got} != {want_r}")
    return checked, bad


def embedded_latencies(emb: Embedded, stream: Stream, n_queries: int) -> dict[str, dict[int, list[float]]]:
    """In-process: the embedded `score` (full answer, u32 array in) and the index lookup alone."""
    rng = random.Random(1)
    out: dict[str, dict[int, list[float]]] = {"embedded": {}, "lookup": {}}
    index = emb.idx.service.index
    for size in SIZES:
        docs = [np.asarray(stream.docs[rng.randrange(len(stream.docs))][:size], dtype=np.uint32)
                for _ in range(n_queries)]
        for name, fn in (("embedded", emb.idx.score), ("lookup", lambda d: index.score("default", d))):
            for d in docs[:10]:
                fn(d)
            ts = out[name][size] = []
            for d in docs:
                a = time.perf_counter()
                fn(d)
                ts.append(time.perf_counter() - a)
    return out


def measure(args: argparse.Namespace, kind: str, shape: str, dyn_reason: str | None
            ) -> tuple[dict[str, dict[str, Any]], str | None]:
    """One run of one stream in one event shape: ingestion reps, then the latency phase (answers
    checked), then the embedded mode. Returns the results per service and why Dynamo was not measured
    (None: it was)."""
    stream = Stream(args.workers, args.batches, shape=shape, hybrid=args.hybrid, kind=kind)
    backlog = Stream(args.workers, args.batches, seed=2, shape=shape, hybrid=args.hybrid, kind=kind)
    print(f"\n=== stream {kind}, shape {shape}{' (hybrid: 3 groups)' if args.hybrid else ''}: {args.workers} workers, "
          f"{sum(map(len, stream.payloads))} batches, {stream.blocks} blocks stored, {stream.entries} resident "
          f"entries (block size {BS}), then a backlog of {backlog.blocks} blocks; {args.reps} reps (medians); "
          f"queries: {args.queries} per size per format", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {}
    shards = ("--ingest-shards", str(args.ingest_shards)) if args.ingest_shards else ()  # none: its default
    makers: list[tuple[str, Callable[[], Service]]] = [
        ("kvatlas", lambda: Kvatlas(*shards, root=Path(args.kvatlas_root))), ("dynamo", lambda: Dynamo(args.bench_python, args.dynamo_threads))]
    ctx = zmq.Context()
    running: list[Service] = []
    pubs: list[RawPublisher] = []
    pubs_of: dict[str, list[RawPublisher]] = {}
    try:
        # Ingestion one service at a time (the other idle), fresh services each rep, the order
        # alternating; the last rep's pair stays up for the latency phase.
        for rep in range(args.reps):
            last = rep == args.reps - 1
            for name, make in (makers if rep % 2 == 0 else makers[::-1]):
                if name == "dynamo" and dyn_reason:
                    continue
                try:
                    svc = make()
                except Exception as exc:  # Dynamo may not run on this host: report why, keep our numbers
                    if name == "dynamo":
                        dyn_reason = f"python -m dynamo.indexer failed to start: {exc}"
                        continue
                    raise
                running.append(svc)
                res, svc_pubs = ingest(svc, stream, backlog, ctx)
                runs.setdefault(name, []).append(res)
                pubs += svc_pubs
                pubs_of[name] = svc_pubs
                if not last:
                    for p in svc_pubs:
                        p.close()
                    svc.stop()
                    running.remove(svc)
                    pubs = [p for p in pubs if p not in svc_pubs]
        results: dict[str, dict[str, Any]] = {
            name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
        kv_pubs = pubs_of.get("kvatlas", [])
        if args.asgi_peer:  # same stream, replayed from seq 0 by the publishers; latency only
            peer = Kvatlas("--http-fast-path", "off", name="kvatlas-asgi")
            running.append(peer)
            connect(peer, None, len(kv_pubs), kv_pubs, hybrid=args.hybrid)
            wait_visible(peer, backlog, kv_pubs)
            results[peer.name] = {}
        lat_svcs = sorted(running, key=lambda s: s.name != "kvatlas")
        answers: dict[str, dict[str, dict[int, list[bytes]]]] = {}
        for name, lat in latencies(lat_svcs, stream, args.queries, answers).items():
            results[name]["lat"] = lat
        checked, bad = check_answers(lat_svcs, [stream, backlog], args.queries, answers)
        results["kvatlas"]["exact"] = (checked, bad)
        for svc in lat_svcs:  # logged drops / parse failures of the pair that answered the timed queries
            if isinstance(svc, Dynamo):
                results["dynamo"]["log_problems"] = svc.log_problems()
        for svc in [s for s in running if s.name == "kvatlas-asgi"]:
            svc.stop()
            running.remove(svc)
        if not args.no_embedded:
            emb = Embedded()
            try:
                connect(emb, None, len(kv_pubs), kv_pubs, hybrid=args.hybrid)
                wait_visible(emb, backlog, kv_pubs)
                results["embedded"] = embedded_latencies(emb, stream, args.queries)
            finally:
                emb.stop()
    finally:
        for p in pubs:
            p.close()
        for svc in running:
            svc.stop()
        ctx.term()
    return results, dyn_reason


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--batches", type=int, default=1000, help="request batches per worker (plus the long document)")
    ap.add_argument("--queries", type=int, default=200, help="timed queries per size and body format")
    ap.add_argument("--reps", type=int, default=3, help="fresh service pairs for the ingestion figures (median)")
    ap.add_argument("--runs", type=int, default=1, help="whole runs per shape (shapes alternate run by run)")
    ap.add_argument("--streams", default=",".join(KINDS),
                    help="streams, comma-separated: shared (system prompts shared across the fleet), unshared "
                         "(every request the worker's own, some evicted: issue 33's memory measure)")
    ap.add_argument("--shapes", default="map,array",
                    help="event shapes, comma-separated: map (SGLang, vLLM 0.33 tagged maps), array (vLLM's "
                         "array-like tagged events)")
    ap.add_argument("--bench-python", default=str(ROOT / ".venv-bench" / "bin" / "python"))
    ap.add_argument("--ingest-shards", default=None,
                    help="pass kvatlas --ingest-shards N or auto (default: no flag, the service's own default)")
    ap.add_argument("--dynamo-threads", type=int, default=4,
                    help="Dynamo's --threads (1: its single-threaded KvIndexer; >1: its ThreadPoolIndexer)")
    ap.add_argument("--asgi-peer", action="store_true",
                    help="also time a kvatlas started with --http-fast-path off (the ASGI front) in the same run")
    ap.add_argument("--no-embedded", action="store_true", help="skip the embedded-mode rows")
    ap.add_argument("--kvatlas-root", default=str(ROOT),
                    help="the checkout the kvatlas service runs from (another worktree, built in place: an A/B)")
    ap.add_argument("--hybrid", action="store_true",
                    help="a hybrid model's stream in vLLM's group shape (service_stream.HYBRID_GROUPS): every block "
                         "stored in a full-attention, a sliding-window and a Mamba group; kvatlas' answers also "
                         "checked for kv_blocks")
    ap.add_argument("--client", choices=sorted(CLIENTS), default="lean",
                    help="HTTP client for every request (default: a minimal keep-alive client; see LeanHttp)")
    args = ap.parse_args()
    CLIENT[0] = CLIENTS[args.client]
    shapes = args.shapes.split(",")
    kinds = args.streams.split(",")
    for k in kinds:
        if k not in KINDS:
            ap.error(f"unknown stream {k!r} (known: {', '.join(KINDS)})")
    for sh in shapes:
        if sh not in SHAPES:
            ap.error(f"unknown shape {sh!r} (known: {', '.join(SHAPES)})")

    dyn_reason = None
    if not os.path.exists(args.bench_python):
        dyn_reason = f"{args.bench_python} missing: run bash bench/setup_bench_env.sh"
    elif (ROOT / ".venv-bench" / ".dynamo-install-failed").exists():
        dyn_reason = (ROOT / ".venv-bench" / ".dynamo-install-failed").read_text().strip()
    table = []
    for run in range(1, args.runs + 1):
        for kind in kinds:
            for shape in shapes:
                results, dyn_reason = measure(args, kind, shape, dyn_reason)
                report(args, results, dyn_reason)
                checked, bad = results["kvatlas"]["exact"]
                if "dynamo" in results:
                    table.append((run, f"{kind[:5]} {shape}", ratios(results),
                                  f"{checked} {'exact' if not bad else 'MISMATCH'}"))
    print(f"\nkvatlas: {'--ingest-shards ' + args.ingest_shards if args.ingest_shards else 'no flags'}; dynamo: "
          f"--threads {args.dynamo_threads}; its /query takes and answers JSON only, so the 'msgpack' (msgpack body "
          "and answer) and 'binary' (raw u32 body, msgpack answer) rows compare against its JSON /query")
    print("live: first send -> last block visible (the sender is the same raw PUB for both); backlog: SIGCONT -> "
          "last block visible, with everything queued while the service was stopped; CPU us/block is the "
          "service's own cost over the live run (all its threads, incl. the visibility queries)")
    if table:
        summary(args, table)
    return 1 if any("MISMATCH" in t[3] for t in table) else 0


if __name__ == "__main__":
    sys.exit(main())
