"""The OpenAI path's two costs, each against a peer measured in the same run (docs/openai.md):

1. Tokenizing chats that share a long system prompt: `ChatTokenizer.encode_chat` (pieces split on
   special tokens, cached) against the `tokenizers` library encoding the same rendered text whole.
2. A chat request through `kvatlas router --api openai` (tokenize, /score, decide, forward) against
   the same request sent straight to the worker: real processes (indexer, one `kvatlas worker`
   with a near-instant simulated model, router), sequential requests, median latency.

    python -m bench.bench_openai [--quick]

Uses the small test tokenizer (tests/data/tiny-chat); a real model's tokenizer is slower per
token, which makes the cache matter more, not less.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


import httpx  # noqa: E402

from router_api.demo.procs import Child, free_port, kvatlas_cmd, wait_healthy  # noqa: E402
from router_api.tokenization import ChatTokenizer  # noqa: E402

TOK_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "tiny-chat"
WORDS = ("the cache holds key and value blocks for every token of the prompt routing a request to the worker "
         "that already holds its prefix saves prefill time answer briefly and precisely").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def bench_tokenize(n_chats: int, system_words: int) -> None:
    rng = random.Random(1)
    system = {"role": "system", "content": words(rng, system_words)}
    chats = [[system, {"role": "user", "content": words(rng, 20)}] for _ in range(n_chats)]
    tok = ChatTokenizer.from_dir(TOK_DIR)
    texts = [tok.render_chat(c) for c in chats]
    raw = tok.tokenizer
    t0 = time.perf_counter()
    whole = [raw.encode(t, add_special_tokens=False).ids for t in texts]
    t_whole = time.perf_counter() - t0
    tok.encode_chat(chats[0])  # the system prompt enters the cache once
    t0 = time.perf_counter()
    ours = [tok.encode_chat(c) for c in chats]
    t_ours = time.perf_counter() - t0
    assert ours == whole, "cached encoding differs from the library's"
    n_tok = sum(map(len, whole)) / len(whole)
    print(f"tokenize: {n_chats} chats of ~{n_tok:.0f} tokens sharing a {system_words}-word system prompt")
    print(f"  library, whole text : {1e6 * t_whole / n_chats:8.1f} us/chat")
    print(f"  ChatTokenizer cached: {1e6 * t_ours / n_chats:8.1f} us/chat (render + encode)  "
          f"ratio {t_ours / t_whole:.2f}")


def bench_proxy(n: int) -> None:
    with tempfile.TemporaryDirectory(prefix="kvatlas-bench-openai-") as tmpd:
        tmp = Path(tmpd)
        ip, wp, rp = free_port(), free_port(), free_port()
        idx = Child("indexer", kvatlas_cmd("indexer", "--port", str(ip)), tmp)
        kids = [idx]
        try:
            wait_healthy([(idx, f"http://127.0.0.1:{ip}")])
            w = Child("w0", kvatlas_cmd("worker", "--id", "w0", "--port", str(wp), "--indexer", f"http://127.0.0.1:{ip}",
                                        "--tokenizer", str(TOK_DIR), "--speed", "100000"), tmp)
            kids.append(w)
            wait_healthy([(w, f"http://127.0.0.1:{wp}")])
            r = Child("router", kvatlas_cmd("router", "--port", str(rp), "--indexer", f"http://127.0.0.1:{ip}",
                                            "--tokenizer", str(TOK_DIR), "--worker", f"w0=http://127.0.0.1:{wp}"), tmp)
            kids.append(r)
            wait_healthy([(r, f"http://127.0.0.1:{rp}")])
            rng = random.Random(2)
            system = {"role": "system", "content": words(rng, 600)}
            bodies = [{"model": "default", "max_tokens": 1,
                       "messages": [system, {"role": "user", "content": words(rng, 30)}]} for _ in range(n)]
            out = {}
            for name, port in (("direct to the worker", wp), ("through the router", rp),
                               ("direct to the worker (again)", wp)):
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30.0) as c:
                    for b in bodies[:5]:
                        c.post("/v1/chat/completions", json=b).raise_for_status()  # warm connections
                    lat = []
                    for b in bodies:
                        t0 = time.perf_counter()
                        c.post("/v1/chat/completions", json=b).raise_for_status()
                        lat.append(time.perf_counter() - t0)
                out[name] = statistics.median(lat)
            print(f"proxy: {n} sequential chats of ~{len(ChatTokenizer.from_dir(TOK_DIR).encode_chat(bodies[0]['messages']))}"
                  " tokens, one worker, median latency")
            base = (out["direct to the worker"] + out["direct to the worker (again)"]) / 2
            for name, v in out.items():
                print(f"  {name:<30}: {1e3 * v:7.2f} ms")
            print(f"  router overhead: {1e3 * (out['through the router'] - base):.2f} ms per request "
                  f"(ratio {out['through the router'] / base:.2f})")
        finally:
            for k in reversed(kids):
                k.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    bench_tokenize(200 if a.quick else 2000, 2000)
    bench_proxy(40 if a.quick else 200)


if __name__ == "__main__":
    main()
