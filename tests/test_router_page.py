"""The router page of `kvatlas router --api openai` (`GET /`, `GET /router/state`), all real
processes: an indexer with the model's tokenizer, two `kvatlas worker`s (one registered under a
hostile id, markup), and the router with every decision sampled. The state's counts, outcomes and
live accuracy must equal what the answers themselves said (the `x-kvatlas-*` headers and the
engines' `usage.prompt_tokens_details.cached_tokens`); headless Chromium must render the worker
rows and numbers and show the hostile id as text. Then the indexer dies: the next request is a
`fallback` and the page says why."""
from __future__ import annotations

import html
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest

from support.net import free_port, wait_until
from support.tiny_tokenizer import TINY_CHAT
from test_openai_router import BS, Proc, _ok, _route, chat

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# markup the indexer accepts as a worker id (printable, no whitespace, quotes or slashes)
EVIL = "<script>alert(1)<b>w1&amp;"


@pytest.fixture
def page_fleet(tmp_path: Path):
    ip, rp = free_port(), free_port()
    wp = {"w0": free_port(), EVIL: free_port()}
    procs: dict[str, Proc] = {}
    try:
        procs["indexer"] = Proc("indexer", ["indexer", "--port", str(ip), "--block-size", str(BS),
                                            "--tokenizer", f"default={TINY_CHAT}"], tmp_path)
        wait_until(lambda: procs["indexer"].alive() and _ok(f"http://127.0.0.1:{ip}/health"), timeout=60, interval=0.1)
        for i, (w, port) in enumerate(wp.items()):
            procs[f"w{i}"] = Proc(f"worker{i}", ["worker", "--id", w, "--port", str(port), "--indexer",
                                                 f"http://127.0.0.1:{ip}", "--block-size", str(BS),
                                                 "--tokenizer", str(TINY_CHAT), "--speed", "50"], tmp_path)
        for i, port in enumerate(wp.values()):
            wait_until(lambda: procs[f"w{i}"].alive() and _ok(f"http://127.0.0.1:{port}/health"),
                       timeout=120, interval=0.1)
        procs["router"] = Proc("router", [
            "router", "--port", str(rp), "--indexer", f"http://127.0.0.1:{ip}", "--tokenizer", str(TINY_CHAT),
            *(a for w, p in wp.items() for a in ("--worker", f"{w}=http://127.0.0.1:{p}")),
            "--workers-interval", "0", "--decision-log-rate", "1"], tmp_path)
        wait_until(lambda: procs["router"].alive() and _ok(f"http://127.0.0.1:{rp}/health"), timeout=60, interval=0.1)
        yield {"router": f"http://127.0.0.1:{rp}", "procs": procs}
    finally:
        for p in reversed(list(procs.values())):
            p.stop()


def _render(url: str) -> str:
    assert CHROMIUM, "chromium not installed: make test installs it (scripts/ensure-system-deps.sh)"
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             f"--user-data-dir={profile}", "--virtual-time-budget=4000", "--dump-dom", url],
            capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


class Expected:
    """What the answers said, per worker: the page's counts must be these."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, int]] = {}
        self.served: dict[str, int | None] = {}  # request id -> the engine's cached tokens

    def add(self, r: httpx.Response, served: int | None) -> None:
        assert r.status_code in (200, 400), r.text
        w = r.headers["x-kvatlas-worker"]
        route = _route(r)
        row = self.rows.setdefault(w, dict.fromkeys(
            ("routed", "scored", "unscored", "fallback", "compared", "exact", "abs_error"), 0))
        row["routed"] += 1
        predicted = route["predicted_cached_tokens"]
        if predicted == "unscored":
            fallback = route["unscored"] == "retried" or route["unscored"].startswith("indexer_")
            row["fallback" if fallback else "unscored"] += 1
        else:
            row["scored"] += 1
            if served is not None and predicted != "":
                row["compared"] += 1
                row["exact"] += int(predicted) == served
                row["abs_error"] += abs(int(predicted) - served)
        self.served[r.headers["x-kvatlas-request-id"]] = served if predicted != "unscored" else None


def _state(c: httpx.Client, want_routed: int) -> dict:
    """The state once every answer sent has been relayed to its end (the relay's last step runs
    after the client may have read the last byte)."""
    box: dict = {}

    def settled() -> bool:
        box["s"] = s = c.get("/router/state").json()
        return s["inflight"] == 0 and sum(w["answered"] for w in s["workers"]) == want_routed
    wait_until(settled, timeout=30, interval=0.05)
    return box["s"]


def _check(s: dict, exp: Expected) -> None:
    workers = {w["worker_id"]: w for w in s["workers"]}
    for wid, row in exp.rows.items():
        w = workers[wid]
        for k in ("routed", "scored", "unscored", "fallback"):
            assert w[k] == row[k], (wid, k, w, row)
        assert w["answered"] == row["routed"] and w["errors"] == 0 and w["inflight"] == 0
        acc = w["accuracy"]
        assert (acc["compared"], acc["exact"]) == (row["compared"], row["exact"]), (wid, acc, row)
        if row["compared"]:
            assert acc["ratio"] == pytest.approx(row["exact"] / row["compared"])
            assert acc["mean_abs_error_tokens"] == pytest.approx(row["abs_error"] / row["compared"])
    for wid in set(workers) - set(exp.rows):
        assert workers[wid]["routed"] == 0
    total = {k: sum(r[k] for r in exp.rows.values()) for k in ("routed", "compared", "exact", "abs_error")}
    assert s["counts"]["routed"] == total["routed"]
    assert (s["accuracy"]["compared"], s["accuracy"]["exact"]) == (total["compared"], total["exact"])
    (model,) = s["models"]
    assert model["model"] == "default" and model["routed"] == total["routed"]
    assert model["decision_latency"]["n"] == total["routed"]
    samples = {d["request_id"]: d for d in s["decision_log"]["samples"]}
    assert set(samples) == set(exp.served) and s["decision_log"]["rate"] == 1.0
    for rid, served in exp.served.items():
        assert samples[rid]["outcome"] == "answered" and samples[rid]["served"] == served, samples[rid]


def test_router_page_counts_accuracy_and_render(page_fleet) -> None:
    c = httpx.Client(base_url=page_fleet["router"], timeout=60.0)
    exp = Expected()
    empty = c.get("/router/state").json()
    assert empty["counts"]["routed"] == 0 and {w["worker_id"] for w in empty["workers"]} == {"w0", EVIL}
    assert all(w["status"] == "up" for w in empty["workers"]) and empty["indexer"]["ok"] is True

    for q in ("What is the capital of France?", "And of Italy?", "Tell me a story about a router.", "Why?"):
        r = c.post("/v1/chat/completions", json={"model": "default", "messages": chat(q), "max_tokens": 3})
        exp.add(r, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    with c.stream("POST", "/v1/chat/completions", json={"model": "default", "messages": chat("Stream it."),
                                                        "max_tokens": 3, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as st:
        text = st.read().decode()
    served = [int(m) for m in re.findall(r'"cached_tokens":\s*(\d+)', text)]
    exp.add(st, served[-1])
    # nothing to score (a prompt that is neither text nor ids): routed on load alone, `unscored`
    bad = c.post("/v1/completions", json={"model": "default", "prompt": 5, "max_tokens": 1})
    assert _route(bad)["unscored"] == "no_tokens"
    exp.add(bad, None)

    s = _state(c, 6)
    assert s["counts"]["requests"] == 6 and s["status"] == "ok" and s["indexer"]["counts"]["decided"] >= 5
    assert s["decision_latency"]["n"] == 6 and s["decision_latency"]["p99_ms"] is not None
    _check(s, exp)
    assert s["accuracy"]["compared"] == 5  # the four chats and the stream: the engine said its cached tokens

    dom = _render(page_fleet["router"] + "/")
    assert 'id="conn" class="ok">live<' in dom, dom[:3000]
    assert re.search(r'id="routed">6<', dom) and re.search(r'id="requests">6<', dom)
    workers = {w["worker_id"]: w for w in s["workers"]}
    for wid, w in workers.items():
        # the id is a text node: markup shows escaped, and no element of the page came from it
        cell = html.escape(wid, quote=False)
        row = re.search(rf'<tr data-worker="[^"]*" data-status="up">\s*<td class="id" title="ok">{re.escape(cell)}</td>'
                        r'(.*?)</tr>', dom, re.S)
        assert row, (wid, dom[:4000])
        for k in ("routed", "scored", "unscored", "exact", "compared"):
            got = re.search(rf'data-k="{k}">([\d,]+)<', row.group(1))
            value = w[k] if k in ("routed", "scored", "unscored") else w["accuracy"][k]
            assert got and int(got.group(1).replace(",", "")) == value, (wid, k)
    assert "<script>alert(1)" not in dom and "<b>w1" not in dom and "&lt;script&gt;alert(1)&lt;b&gt;w1&amp;amp;" in dom
    assert len(re.findall(r'<tr data-request="kvatlas-[0-9a-f]+" data-outcome="answered">', dom)) == 6
    assert re.search(r'id="indexer-state"[^>]*>ok<', dom)
    decide = html.unescape(re.search(r'id="decide">([^<]+)<', dom).group(1))
    assert re.fullmatch(r"(≤ [\d.]+ ms|> 1 s) · (≤ [\d.]+ ms|> 1 s)", decide), decide
    assert html.unescape(re.search(r'id="accuracy"[^>]*>([^<]+)<', dom).group(1)) == \
        f"{100 * s['accuracy']['ratio']:.1f}%"

    # the indexer dies: the next request is decided on load alone (`fallback`), the page says why
    page_fleet["procs"]["indexer"].stop()
    r = c.post("/v1/chat/completions", json={"model": "default", "messages": chat("Still there?"), "max_tokens": 2})
    assert r.status_code == 200 and _route(r)["unscored"].startswith("indexer_"), r.headers
    exp.add(r, None)
    s = _state(c, 7)
    _check(s, exp)
    assert s["status"] == "degraded" and s["indexer"]["ok"] is False and s["indexer"]["state"] != "ok"
    assert sum(w["fallback"] for w in s["workers"]) == 1
    dom = _render(page_fleet["router"] + "/")
    assert re.search(r'id="indexer-state"[^>]*>degraded<', dom)
    assert re.search(r'id="status"><span class="status degraded">degraded<', dom)
