"""/health latency while a client scores a 480k-token query back to back (issue 24's hostile scorer):
kvatlas answering large bodies off the event loop (the default, router_api/offload.py) vs on it
(`--http-offload-bytes 0`, the behaviour before), in the same run.

  .venv/bin/python -m bench.bench_health_under_load [--seconds 10] [--rounds 2] [--scorers 1] [--base-tree DIR]

Per round and mode a fresh `kvatlas indexer` starts; one worker (a real ZeroMQ publisher) stores a
30,000-block chain (block size 16); `--scorers` clients POST the whole chain's 480k tokens as JSON
(~3.2 MB) back to back while a separate process GETs /health every 10 ms (its own process: the bench's
threads and GIL add nothing to its latencies). Every /score answer must report the worker's 30,000
blocks (else exit 1). The modes alternate round by round (on a shared, loaded host, load hits both).
`--base-tree DIR` adds a third mode, `base`: the indexer of another checkout (e.g. a `git worktree` of
the base commit, with its own built .venv), run the same way. Printed: /health p50 / p99 / max and the
/score rate per mode and round, then the ratios of the medians over rounds against offload-off (and
against base) — lower is better for /health.
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent

from producer.publisher import ZmqEventPublisher  # noqa: E402
from schemas.events import BlockStored  # noqa: E402

BS = 16
BASE_PYTHON: str | None = None  # --base-python
BLOCKS = 30_000

_PROBE = ["-m", "bench.support.health_probe"]  # GET /health every 10 ms from its own process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(pred, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def one(mode: str, seconds: float, scorers: int, tokens: list[int], hashes: list[int], body: bytes,
        base: Path | None) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    extra = ["--http-offload-bytes", "0"] if mode == "off" else []
    tree, python = (base, BASE_PYTHON or str(base / ".venv/bin/python")) if mode == "base" and base else \
        (REPO, sys.executable)
    entry = "cli.main" if (tree / "cli" / "main.py").exists() else "router_api.cli"  # a base tree may predate cli/
    proc = subprocess.Popen([python, "-m", entry, "indexer", "--port", str(port), "--block-size",
                             str(BS), *extra], cwd=str(tree), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pub = ZmqEventPublisher("tcp://127.0.0.1:*")
    client = httpx.Client(base_url=url, timeout=60.0)
    try:
        def up() -> bool:
            try:
                return client.get("/health").status_code == 200
            except httpx.HTTPError:
                return False
        wait(up, 60, "the indexer")
        r = client.post("/workers", json={"worker_id": "w0", "endpoint": pub.endpoint, "block_size": BS})
        assert r.status_code == 201, r.text

        def joined() -> bool:
            pub.heartbeat()
            return client.get("/workers").json()["workers"][0]["last_seq"] is not None
        wait(joined, 30, "the subscription")
        for a in range(0, BLOCKS, 3000):
            b = a + 3000
            pub.publish([BlockStored(hashes[a:b], hashes[a - 1] if a else None, tokens[a * BS:b * BS], BS)])
        pub.flush(30)
        mark = pub.next_seq - 1
        wait(lambda: (client.get("/workers").json()["workers"][0]["last_seq"] or 0) >= mark, 60, "the chain")
        probe = subprocess.Popen([sys.executable, *_PROBE, url, "10"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, cwd=str(REPO))
        stop = threading.Event()
        answers: list[int] = []
        bad: list[str] = []

        def score() -> None:
            with httpx.Client(base_url=url, timeout=120.0) as c:
                while not stop.is_set():
                    resp = c.post("/score", content=body, headers={"content-type": "application/json"})
                    row = resp.json()["workers"][0] if resp.status_code == 200 else None
                    if row is None or row["device_blocks"] != BLOCKS:
                        bad.append(f"{resp.status_code} {resp.text[:200]}")
                    answers.append(1)
        threads = [threading.Thread(target=score, daemon=True) for _ in range(scorers)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(seconds)  # the measured interval
        stop.set()
        for t in threads:
            t.join(120)
        dt = time.monotonic() - t0
        out, _ = probe.communicate("", timeout=120)
        got = json.loads(out)
        if bad or got["errors"]:
            raise SystemExit(f"wrong answers or /health errors in mode {mode}: {bad[:3]} {got['errors'][:3]}")
        ms = got["ms"]
        return {"p50": statistics.median(ms), "p99": statistics.quantiles(ms, n=100, method="inclusive")[98],
                "max": max(ms),
                "n": len(ms), "scores_s": len(answers) / dt}
    finally:
        client.close()
        pub.close()
        proc.terminate()
        proc.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds per round and mode")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scorers", type=int, default=1, help="clients scoring the 480k-token query back to back")
    ap.add_argument("--base-tree", type=Path, help="also run the indexer of this checkout (mode `base`)")
    ap.add_argument("--base-python", help="the interpreter for --base-tree (default: DIR/.venv/bin/python)")
    args = ap.parse_args()
    global BASE_PYTHON
    BASE_PYTHON = args.base_python
    rng = random.Random(11)
    tokens = [rng.randrange(1, 50_000) for _ in range(BLOCKS * BS)]
    hashes = rng.sample(range(1, 1 << 62), BLOCKS)
    body = json.dumps({"token_ids": tokens}).encode()
    print(f"/score body: {len(tokens)} tokens, {len(body)} bytes; {args.scorers} scorer(s); /health every 10 ms")
    modes = ["off", "on"] + (["base"] if args.base_tree else [])
    res: dict[str, list[dict]] = {m: [] for m in modes}
    for rnd in range(args.rounds):
        for mode in (modes if rnd % 2 == 0 else modes[::-1]):
            r = one(mode, args.seconds, args.scorers, tokens, hashes, body, args.base_tree)
            res[mode].append(r)
            print(f"round {rnd} {'offload ' + mode if mode != 'base' else 'base tree  '}: /health p50 {r['p50']:7.2f} ms  p99 {r['p99']:7.2f} ms  "
                  f"max {r['max']:7.2f} ms  ({r['n']} samples)  /score {r['scores_s']:.1f}/s", flush=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("p50", "p99", "max", "scores_s")} for m, rs in res.items()}
    for k in ("p50", "p99", "max", "scores_s"):
        what = "/score rate (per s)" if k == "scores_s" else f"/health {k} (ms)"
        line = f"{what}: offload on {med['on'][k]:.2f}, off {med['off'][k]:.2f}, ratio on/off {med['on'][k] / med['off'][k]:.3f}"
        if "base" in med:
            line += f"; base {med['base'][k]:.2f}, ratio on/base {med['on'][k] / med['base'][k]:.3f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
