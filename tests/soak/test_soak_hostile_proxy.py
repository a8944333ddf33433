"""A hostile soak of the OpenAI proxy (issue 37; docs/reference.md, "Security"), beside the route
plane's (test_soak_hostile_routes.py): real processes — an indexer with the model's tokenizer, two
`kvatlas worker`s, `kvatlas router --api openai` — and, in front of it, an engine that answers its
/metrics and never a request, one whose /metrics drips a byte at a time, one whose /metrics never ends.
Attackers send huge chats (tokenized in the proxy's bounded pool, or past its bound not at all), JSON
nested 200,000 deep, `chat_template_kwargs` as a list, heads that never end, connections that send
nothing, and requests abandoned mid-body, before the answer and mid-stream. An honest client keeps
chatting (streamed and not); probes time the proxy's and the indexer's /health from processes of their
own.

Asserted: every honest answer is exact (the prompt ids the worker saw are the template's, the output
has the asked length), every hostile request is refused 4xx or served, never 5xx; the dripping and
endless /metrics mark their engines down and the silent one is skipped after the first-byte deadline;
held connections are closed by the server; the workers cancelled abandoned requests; afterwards no
route is held (the indexer's in-flight count is back to 0, released, not expired) and the proxy counts
nothing in flight; the proxy's RSS stayed bounded; /health always answered 200. Short by default
(inside `make test`); `KVATLAS_SOAK_S=60` runs longer and then also holds both /health p99 under 100 ms.
Loopback only."""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import httpx
import pytest

from router_api.tokenization import ChatTokenizer
from support.hostile import HealthProbe, closed_by_server, rss_kb, slowloris
from support.hostile_http import FakeEngine, ProxyAttacker, get_text, idle_connections, metric
from support.net import free_port, wait_until
from support.tiny_tokenizer import TINY_CHAT
from test_openai_router import Proc, _ok, _sse

pytestmark = pytest.mark.slow

BS = 4
SOAK_S = float(os.environ.get("KVATLAS_SOAK_S", "6"))
LONG = SOAK_S >= 30
FIRST_BYTE_S = 3.0
TOK = ChatTokenizer.from_dir(TINY_CHAT)
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly; the cache holds key and value "
                                       "blocks for every token of the prompt."}


def _honest(c: httpx.Client, i: int) -> None:
    """One honest chat, checked exactly: the ids the worker saw, the output's length."""
    msgs = [SYSTEM, {"role": "user", "content": f"Question number {i}: what is block {i % 7}?"}]
    want = TOK.encode_chat(msgs)
    n_out = 2 + i % 4
    if i % 3:
        r = c.post("/v1/chat/completions", json={"model": "default", "messages": msgs, "max_tokens": n_out,
                                                 "return_token_ids": True})
        assert r.status_code == 200, (r.status_code, r.text[:300])
        body = r.json()
        assert body["prompt_token_ids"] == want
        assert body["usage"]["completion_tokens"] == n_out
    else:
        r = c.post("/v1/chat/completions", json={"model": "default", "messages": msgs, "max_tokens": n_out,
                                                 "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200, (r.status_code, r.text[:300])
        usage = _sse(r.text)[-1]["usage"]  # _sse asserts the stream ended with [DONE]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(want), n_out)


def _held(proxy_metrics: str, indexer_metrics: str) -> str:
    return "held: " + " | ".join(line for line in (proxy_metrics + indexer_metrics).splitlines()
                                 if line.startswith(("kvatlas_router_inflight", "kvatlas_pending_routes")))


def test_hostile_proxy_soak(tmp_path: Path) -> None:
    ip, rp = free_port(), free_port()
    wp = {"w0": free_port(), "w1": free_port()}
    fakes = {m: FakeEngine(m) for m in ("hang", "drip", "huge")}
    procs: dict[str, Proc] = {}
    attackers: list[ProxyAttacker] = []
    probes: list[HealthProbe] = []
    held: list[socket.socket] = []
    try:
        procs["indexer"] = Proc("indexer", ["indexer", "--port", str(ip), "--block-size", str(BS),
                                            "--tokenizer", f"default={TINY_CHAT}"], tmp_path)
        for w, port in wp.items():
            procs[w] = Proc(w, ["worker", "--id", w, "--port", str(port), "--indexer", f"http://127.0.0.1:{ip}",
                                "--block-size", str(BS), "--tokenizer", str(TINY_CHAT), "--speed", "50"], tmp_path)
        workers = [f"{w}=http://127.0.0.1:{p}" for w, p in wp.items()] + [f"{m}={f.url}" for m, f in fakes.items()]
        procs["router"] = Proc("router", [
            "router", "--port", str(rp), "--indexer", f"http://127.0.0.1:{ip}", "--tokenizer", str(TINY_CHAT),
            *[a for w in workers for a in ("--worker", w)], "--workers-interval", "0", "--metrics-interval", "0.5",
            "--first-byte-timeout", str(FIRST_BYTE_S), "--request-timeout", "2", "--max-connections", "512"],
            tmp_path)
        router, indexer = f"http://127.0.0.1:{rp}", f"http://127.0.0.1:{ip}"
        for name, url in [("indexer", indexer)] + [(w, f"http://127.0.0.1:{p}") for w, p in wp.items()]:
            wait_until(lambda name=name, url=url: procs[name].alive() and _ok(f"{url}/health"), timeout=120,
                       interval=0.1)

        def fleet_seen() -> bool:  # both workers up at the proxy, the three fakes judged
            h = httpx.get(f"{router}/health", timeout=5.0).json()["workers"]
            return h["w0"]["up"] and h["w1"]["up"] and h["hang"]["up"] and not h["drip"]["up"] \
                and not h["huge"]["up"]
        wait_until(lambda: procs["router"].alive() and _ok(f"{router}/health") and fleet_seen(), timeout=120,
                   interval=0.1)
        c = httpx.Client(base_url=router, timeout=60.0)
        for i in range(4):  # warm: the system prompt is cached, the tokenizer loaded
            _honest(c, i)
        rss0 = rss_kb(procs["router"].proc.pid)
        probes = [HealthProbe(router), HealthProbe(indexer)]
        attackers = [ProxyAttacker(k, rp) for k in ProxyAttacker.ATTACKS]
        for a in attackers:
            a.start()
        end = time.monotonic() + SOAK_S
        honest = held_total = 0
        rss_max = rss0
        while time.monotonic() < end:
            _honest(c, honest)
            honest += 1
            if honest % 5 == 0:
                if len(held) >= 300:  # every one ended at the head deadline (408), not by us; then more
                    closed_by_server(held)
                    held_total += len(held)
                    for s in held:
                        s.close()
                    held = []
                held += slowloris(rp, 10) + idle_connections(rp, 10)
            rss_max = max(rss_max, rss_kb(procs["router"].proc.pid))
        for a in attackers:
            a.stop.set()
        for a in attackers:
            a.join(60)
        for p in probes:
            p.stop()
        closed_by_server(held)
        held_total += len(held)

        # afterwards: nothing in flight at the proxy, no route held at the indexer (released, not expired)
        def quiet() -> bool:
            m = get_text(f"{router}/metrics")
            return metric(m, "kvatlas_router_inflight{") == 0 and \
                metric(get_text(f"{indexer}/metrics"), "kvatlas_pending_routes ") == 0
        try:
            wait_until(quiet, timeout=8.0, interval=0.1)  # under the routes' 10 s TTL: released, not expired
        except AssertionError:
            raise AssertionError(_held(get_text(f"{router}/metrics"), get_text(f"{indexer}/metrics"))) from None
        im = get_text(f"{indexer}/metrics")
        assert metric(im, 'kvatlas_pending_routes_total{outcome="expired"}') == 0
        assert metric(im, 'kvatlas_pending_routes_total{outcome="added"}') >= honest
        _honest(c, honest)  # still serving
        pm = get_text(f"{router}/metrics")
        health = httpx.get(f"{router}/health", timeout=5.0).json()["workers"]
        rss1 = rss_kb(procs["router"].proc.pid)
        procs["router"].alive()

        for a in attackers:
            assert not a.errors, a.errors[:3]
            assert a.sent > 0, a.kind
            assert not any(code >= 500 for code in a.seen), (a.kind, a.seen)  # refused 4xx or served, never 5xx
        seen = {a.kind: a.seen for a in attackers}
        assert set(seen["huge_chat"]) <= {200, 413} and 413 in seen["huge_chat"], seen
        assert set(seen["deep_json"]) == {400} and set(seen["bad_kwargs"]) == {400}, seen
        assert set(seen["leave_mid_stream"]) == {200}, seen
        # the metrics that drip or never end are cut off by the poll's deadline and size cap
        assert not health["drip"]["up"] and "longer than" in health["drip"]["reason"], health["drip"]
        assert not health["huge"]["up"] and "larger than" in health["huge"]["reason"], health["huge"]
        huge = fakes["huge"].counts  # each poll read no further than the 4 MiB cap (and the socket buffers)
        assert 0 < huge["huge_bytes"] <= huge["metrics"] * (16 << 20), huge
        # the silent engine: every request sent to it was hung up on (the first-byte deadline, or its
        # client left), none held; the deadline fired (honest and streamed requests wait for a first byte)
        hang = fakes["hang"].counts
        silent = hang["requests"]
        wait_until(lambda: hang["abandoned"] + hang["cut"] == silent, timeout=10.0, interval=0.1)
        assert silent == 0 or metric(pm, 'kvatlas_router_requests_total{outcome="first_byte_timeouts"}') > 0
        wm = "".join(get_text(f"http://127.0.0.1:{p}/metrics") for p in wp.values())
        assert metric(wm, "kvatlas_worker_openai_requests_total{", 'outcome="cancelled"') > 0  # abandoned work was cancelled
        assert rss1 < rss0 + 400 * 1024 and rss_max < rss0 + 600 * 1024, (rss0, rss_max, rss1)
        figures = []
        for name, p in zip(("proxy", "indexer"), probes):
            assert not p.errors, (name, p.errors[:3])
            n, p50, p99 = p.summary()
            figures.append(f"{name} /health n={n} p50={p50:.1f}ms p99={p99:.1f}ms")
            if LONG:
                assert p99 < 100.0, (name, n, p50, p99)
        print(f"proxy soak {SOAK_S:g}s: honest={honest} attacks={ {a.kind: a.sent for a in attackers} } "
              f"silent_engine_requests={silent} held_connections={held_total} " + " ".join(figures) +
              f" proxy RSS {rss0 // 1024} -> max {rss_max // 1024} -> {rss1 // 1024} MB")
    finally:
        for a in attackers:
            a.stop.set()
        for p in probes:
            p.stop()
        for s in held:
            s.close()
        for p in reversed(list(procs.values())):
            p.stop()
        for f in fakes.values():
            f.close()
