"""`kvatlas router --api openai` end to end, all real processes over plain HTTP: an indexer with the
model's tokenizer, two `kvatlas worker`s speaking vLLM's API, and the router. Chat and completions,
streaming and not; the prompt a worker received is the ids that were scored; a second request
sharing a system prompt goes to the worker holding it; a worker killed mid-run is skipped without
a failed request."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from router_api.tokenization import ChatTokenizer
from support.net import REPO_ROOT, free_port, wait_until
from support.tiny_tokenizer import TINY_CHAT
from router_api.procs import spawn

BS = 4
TOK = ChatTokenizer.from_dir(TINY_CHAT)
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer the question briefly and precisely. "
                                       "The cache holds key and value blocks for every token of the prompt."}


def chat(user: str) -> list[dict[str, str]]:
    return [SYSTEM, {"role": "user", "content": user}]


class Proc:
    def __init__(self, name: str, args: list[str], tmp: Path) -> None:
        self.name = name
        self.log = tmp / f"{name}.log"
        self._f = open(self.log, "ab")
        self.proc = spawn([sys.executable, "-m", "cli.main", *args], cwd=str(REPO_ROOT),
                                     stdout=self._f, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")
        return True

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._f.close()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def fleet(tmp_path: Path):
    ip, rp = free_port(), free_port()
    wp = {"w0": free_port(), "w1": free_port()}
    procs: dict[str, Proc] = {}
    try:
        procs["indexer"] = Proc("indexer", ["indexer", "--port", str(ip), "--block-size", str(BS),
                                            "--tokenizer", f"default={TINY_CHAT}"], tmp_path)
        wait_until(lambda: procs["indexer"].alive() and _ok(f"http://127.0.0.1:{ip}/health"), timeout=60, interval=0.1)
        for w, port in wp.items():
            procs[w] = Proc(w, ["worker", "--id", w, "--port", str(port), "--indexer", f"http://127.0.0.1:{ip}",
                                "--block-size", str(BS), "--tokenizer", str(TINY_CHAT), "--speed", "20"], tmp_path)
        for w, port in wp.items():
            wait_until(lambda: procs[w].alive() and _ok(f"http://127.0.0.1:{port}/health"), timeout=120, interval=0.1)
        # A long metrics interval: a killed worker is found by the forwarder's connection failure
        # (the retry under test), not by a poll that happens to come first.
        procs["router"] = Proc("router", [
            "router", "--port", str(rp), "--indexer", f"http://127.0.0.1:{ip}", "--tokenizer", str(TINY_CHAT),
            "--worker", f"w0=http://127.0.0.1:{wp['w0']}", "--worker", f"w1=http://127.0.0.1:{wp['w1']}",
            "--metrics-interval", "600"], tmp_path)
        wait_until(lambda: procs["router"].alive() and _ok(f"http://127.0.0.1:{rp}/health"), timeout=60, interval=0.1)
        yield {"router": f"http://127.0.0.1:{rp}", "indexer": f"http://127.0.0.1:{ip}", "procs": procs,
               "workers": {w: f"http://127.0.0.1:{p}" for w, p in wp.items()}}
    finally:
        for p in reversed(list(procs.values())):
            p.stop()


def _sse(text: str) -> list[dict]:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _route(r: httpx.Response) -> dict[str, str]:
    return dict(p.split("=", 1) for p in r.headers["x-kvatlas-route"].split("; "))


def test_openai_router_end_to_end(fleet) -> None:
    c = httpx.Client(base_url=fleet["router"], timeout=60.0)
    idx = httpx.Client(base_url=fleet["indexer"], timeout=10.0)
    models = c.get("/v1/models").json()
    assert models["data"][0]["id"] == "default"
    # the workers speak vLLM's /tokenize and gauge names
    w0 = httpx.Client(base_url=fleet["workers"]["w0"], timeout=10.0)
    tk = w0.post("/tokenize", json={"model": "default", "messages": chat("Hi")}).json()
    assert tk["tokens"] == TOK.encode_chat(chat("Hi")) and tk["count"] == len(tk["tokens"])
    assert w0.post("/tokenize", json={"prompt": "Hi"}).json()["tokens"] == TOK.encode_prompt("Hi")
    assert 'vllm:num_requests_waiting{model_name="default"} 0' in w0.get("/metrics").text

    # 1. a chat, not streamed: the worker's prompt is the template's ids, which the router scored
    first = c.post("/v1/chat/completions", json={"model": "default", "messages": chat("What is the capital of France?"),
                                                 "max_tokens": 4, "return_token_ids": True})
    assert first.status_code == 200, first.text
    holder = first.headers["x-kvatlas-worker"]
    body = first.json()
    want = TOK.encode_chat(chat("What is the capital of France?"))
    assert body["prompt_token_ids"] == want
    assert int(_route(first)["prompt_tokens"]) == len(want)
    assert body["choices"][0]["message"]["role"] == "assistant" and body["usage"]["completion_tokens"] == 4
    # the indexer, asked with the same messages, scores those very ids
    assert idx.post("/score", json={"messages": chat("What is the capital of France?")}).json()["prompt_tokens"] == len(want)

    # 2. the worker's KV events reach the index; the next chat sharing the system prompt goes there
    follow = chat("Tell me a story about a router.")
    system_blocks = len(TOK.encode_chat([SYSTEM], add_generation_prompt=False)) // BS

    def indexed() -> bool:
        rows = {r["worker_id"]: r["cached_blocks"] for r in idx.post("/score", json={"messages": follow}).json()["workers"]}
        return rows.get(holder, 0) >= system_blocks - 1
    wait_until(indexed, timeout=30, interval=0.05)
    second = c.post("/v1/chat/completions", json={"model": "default", "messages": follow, "max_tokens": 3})
    assert second.status_code == 200 and second.headers["x-kvatlas-worker"] == holder
    assert int(_route(second)["predicted_cached_tokens"]) > 0
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the worker's own truth

    # 3. streamed chat: SSE passed through, same worker
    with c.stream("POST", "/v1/chat/completions", json={"model": "default", "messages": chat("And Paris?"),
                                                        "max_tokens": 5, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        assert s.headers["x-kvatlas-worker"] == holder
        chunks = _sse(s.read().decode())
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum(1 for ch in chunks if ch["choices"] and ch["choices"][0]["delta"].get("content")) == 5
    assert chunks[-1]["usage"]["completion_tokens"] == 5

    # 4. completions, text and token ids, streamed and not
    text = "The cache holds key and value blocks"
    comp = c.post("/v1/completions", json={"model": "default", "prompt": text, "max_tokens": 2, "return_token_ids": True})
    assert comp.status_code == 200 and comp.json()["prompt_token_ids"] == TOK.encode_prompt(text)
    assert comp.json()["object"] == "text_completion" and int(_route(comp)["prompt_tokens"]) == len(TOK.encode_prompt(text))
    with c.stream("POST", "/v1/completions", json={"model": "default", "prompt": TOK.encode_prompt(text),
                                                   "max_tokens": 3, "stream": True}) as s:
        chunks = _sse(s.read().decode())
    assert len(chunks) == 3 and chunks[-1]["choices"][0]["finish_reason"] == "length"

    # 5. the worker holding the prefix is killed: the router picks it (its cache), fails to connect,
    #    and serves from the other one; no request fails
    other = "w1" if holder == "w0" else "w0"
    fleet["procs"][holder].stop(signal.SIGKILL)
    for q in ("Why is the sky blue?", "Name a colour."):
        r = c.post("/v1/chat/completions", json={"model": "default", "messages": chat(q), "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvatlas-worker"] == other
    health = c.get("/health").json()
    assert health["workers"][holder]["up"] is False and health["workers"][other]["up"] is True
    metrics = c.get("/metrics").text
    assert 'kvatlas_router_requests_total{outcome="retries"} 1' in metrics
    assert f'kvatlas_router_worker_up{{worker="{holder}"}} 0' in metrics


def test_demo_runs_through_the_openai_path() -> None:
    out = subprocess.run([sys.executable, "-m", "cli.main", "demo", "--openai", "--workers", "2",
                          "--requests", "6", "--policies", "round_robin,precise_tiered", "--speed", "50"],
                         cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = {ln.split()[0]: ln.split() for ln in out.stdout.splitlines()
            if ln.split() and ln.split()[0] in ("round_robin", "precise_tiered")}
    assert set(rows) == {"round_robin", "precise_tiered"}
    for cols in rows.values():
        assert cols[1] == "24" and cols[-1] == "0"  # 6 chats x 4 turns, no errors
    assert rows["round_robin"][4] == "-" and rows["precise_tiered"][4].endswith("%")
