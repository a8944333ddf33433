"""`kvatlas demo --openai`: the whole OpenAI path on real processes — an indexer, per policy a fresh
set of `kvatlas worker`s speaking vLLM's API and a `kvatlas router --api openai` — driven by
multi-turn chats over plain HTTP (several conversations share each system prompt), one table at the
end (docs/openai.md). The hit ratio is the workers' own count of prompt tokens they already held
(`usage.prompt_tokens_details.cached_tokens`); "prediction" is the share of requests whose
predicted cached tokens (the router's `x-kvatlas-route`) equal that count."""
from __future__ import annotations

import logging
import random
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from router.demo.procs import Child, free_port, kvatlas_cmd, wait_healthy

TOKENIZER = Path(__file__).resolve().parents[2] / "tests" / "data" / "tiny-chat"
BLOCK = 16
_WORDS = ("the cache holds key and value blocks for every token of the prompt routing a request to worker "
          "that already its prefix saves prefill time answer question briefly precisely story about router "
          "indexer two workers sharing system you are helpful assistant capital france paris").split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + "."


def conversations(seed: int, n: int, systems: int, turns: int) -> list[list[str]]:
    """n conversations (each a system prompt index and user turns) over `systems` shared system prompts."""
    rng = random.Random(seed)
    return [[str(rng.randrange(systems))] + [_text(rng, rng.randint(8, 30)) for _ in range(turns)] for _ in range(n)]


class Row:
    __slots__ = ("policy", "requests", "prompt_tokens", "cached_tokens", "predicted", "exact", "errors", "per_worker")

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.requests = self.prompt_tokens = self.cached_tokens = self.predicted = self.exact = self.errors = 0
        self.per_worker: dict[str, int] = {}


def _chat(c: httpx.Client, model: str, system: str, convo: list[str], row: Row) -> None:
    msgs: list[dict[str, str]] = [{"role": "system", "content": system}]
    for user in convo:
        msgs.append({"role": "user", "content": user})
        r = c.post("/v1/chat/completions", json={"model": model, "messages": msgs, "max_tokens": 12})
        row.requests += 1
        if r.status_code != 200:
            row.errors += 1
            return
        body = r.json()
        usage = body["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        row.prompt_tokens += usage["prompt_tokens"]
        row.cached_tokens += cached
        route = dict(p.split("=", 1) for p in r.headers["x-kvatlas-route"].split("; "))
        predicted = route.get("predicted_cached_tokens") or None  # empty: the policy predicts nothing
        if predicted is not None:
            row.predicted += 1
            row.exact += predicted == str(cached)
        w = r.headers["x-kvatlas-worker"]
        row.per_worker[w] = row.per_worker.get(w, 0) + 1
        msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})


def run_openai_demo(policies: Sequence[str], workers: int, conversations_n: int, seed: int, speed: float,
                    gpu_pages: int, out: Any) -> list[Row]:
    p = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    rng = random.Random(seed)
    systems = [_text(rng, 120) for _ in range(max(2, conversations_n // 4))]
    convos = conversations(seed, conversations_n, len(systems), 4)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvatlas-openai-demo-") as tmpd:
        tmp = Path(tmpd)
        ip = free_port()
        indexer = f"http://127.0.0.1:{ip}"
        idx = Child("indexer", kvatlas_cmd("indexer", "--port", str(ip), "--block-size", str(BLOCK),
                                           "--tokenizer", f"default={TOKENIZER}"), tmp)
        children: list[Child] = []
        try:
            wait_healthy([(idx, indexer)])
            p(f"kvatlas demo --openai: indexer + {workers} workers (vLLM's API) + an OpenAI router per policy, "
              f"{conversations_n} chats of 4 turns over {len(systems)} shared system prompts")
            for n, policy in enumerate(policies):
                model = f"run{n}"
                urls = {}
                for j in range(workers):
                    wid, port = f"r{n}-w{j}", free_port()
                    children.append(Child(wid, kvatlas_cmd(
                        "worker", "--id", wid, "--port", str(port), "--indexer", indexer, "--model", model,
                        "--block-size", str(BLOCK), "--gpu-pages", str(gpu_pages), "--host-pages", "0",
                        "--tokenizer", str(TOKENIZER), "--speed", str(speed)), tmp))
                    urls[wid] = f"http://127.0.0.1:{port}"
                wait_healthy([(c, u) for c, u in zip(children[-workers:], urls.values())])
                rp = free_port()
                router = Child(f"router{n}", kvatlas_cmd(
                    "router", "--port", str(rp), "--indexer", indexer, "--model", model, "--policy", policy,
                    "--tokenizer", str(TOKENIZER), *[a for w, u in urls.items() for a in ("--worker", f"{w}={u}")]),
                    tmp)
                children.append(router)
                wait_healthy([(router, f"http://127.0.0.1:{rp}")])
                row = Row(policy)
                t0 = time.monotonic()
                with httpx.Client(base_url=f"http://127.0.0.1:{rp}", timeout=120.0) as c, ThreadPoolExecutor(4) as ex:
                    list(ex.map(lambda cv: _chat(c, model, systems[int(cv[0])], cv[1:], row), convos))
                rows.append(row)
                p(f"  {policy}: {row.requests} requests in {time.monotonic() - t0:.1f}s, "
                  f"per worker {dict(sorted(row.per_worker.items()))}")
                for ch in children[-workers - 1:]:
                    ch.stop()
        finally:
            for ch in children:
                ch.stop()
            idx.stop()
    p("")
    p(f"{'policy':<16}{'requests':>9}{'hit ratio':>11}{'prefill tokens':>16}{'prediction':>12}{'errors':>8}")
    for r in rows:
        hit = r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
        pred = f"{100 * r.exact / r.predicted:.1f}%" if r.predicted else "-"
        p(f"{r.policy:<16}{r.requests:>9}{hit:>11.3f}{r.prompt_tokens - r.cached_tokens:>16}{pred:>12}{r.errors:>8}")
    p("\nhit ratio: prompt tokens the worker already held / all prompt tokens (the workers' own usage counts).")
    p("prediction: requests whose predicted cached tokens (x-kvatlas-route) equal the worker's count.")
    return rows
