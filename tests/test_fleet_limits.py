"""`kvatlas worker` and `kvatlas router` against an indexer run with auth, and their bounds
(issue 24): the worker registers with the token, the router's decisions are made with it; both
refuse oversized bodies (413), the worker absurd max_tokens / arrival_s (422). Real processes, real
HTTP."""
from __future__ import annotations

import json
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

from router.demo.procs import Child, http_json, wait_healthy
from support.net import free_port

BLOCK = 16
TOKEN = "fleet-secret-token"


def post(url: str, body: bytes | dict, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def declared_too_big(port: int, length: int, path: bytes = b"/generate") -> bytes:
    """POST `path` declaring `length` body bytes, none sent: the status line of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % (path, length))
        return s.recv(4096).split(b"\r\n", 1)[0]


def test_worker_and_router_work_with_an_auth_indexer_and_bound_their_inputs(tmp_path: Path) -> None:
    ip, wp, rp = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "cli.main", "--log-level", "WARNING"]
    env = {"KVATLAS_AUTH_TOKEN": TOKEN}
    idx = Child("indexer", [*cmd, "indexer", "--port", str(ip), "--block-size", str(BLOCK)], tmp_path, env)
    w = Child("worker", [*cmd, "worker", "--id", "w0", "--port", str(wp), "--indexer", f"http://127.0.0.1:{ip}",
                         "--block-size", str(BLOCK), "--gpu-pages", "64", "--speed", "1000"], tmp_path, env)
    router = None
    try:
        wait_healthy([(idx, f"http://127.0.0.1:{ip}"), (w, f"http://127.0.0.1:{wp}")])
        auth = {"Authorization": f"Bearer {TOKEN}"}
        rows = json.loads(urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{ip}/workers", headers=auth), timeout=10).read())["workers"]
        assert [r["worker_id"] for r in rows] == ["w0"]  # registered through the auth check
        router = Child("router", [*cmd, "router", "--indexer", f"http://127.0.0.1:{ip}", "--worker",
                                  f"w0=http://127.0.0.1:{wp}", "--port", str(rp), "--policy", "precise_tiered",
                                  "--max-body-mb", "1", "--api", "openai", "--block-size", str(BLOCK)], tmp_path, env)
        wait_healthy([(router, f"http://127.0.0.1:{rp}")])
        prompt = list(range(1, 4 * BLOCK + 1))
        for i in range(3):
            req = urllib.request.Request(f"http://127.0.0.1:{rp}/v1/completions", method="POST",
                                         data=json.dumps({"prompt": prompt, "max_tokens": 2}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                route = r.headers["x-kvatlas-route"]
                assert r.status == 200 and r.headers["x-kvatlas-worker"] == "w0"
            # decided by the indexer with the token: scored, not routed on load
            assert "unscored" not in route and "predicted_cached_tokens=" in route, route
        assert http_json(f"http://127.0.0.1:{rp}/health")["indexer"]["state"] == "ok"
        # Bounds, on the worker and the router alike.
        assert declared_too_big(rp, 2 * 1024 * 1024, b"/v1/completions") == b"HTTP/1.1 413 Request Entity Too Large"
        assert declared_too_big(wp, 200 * 1024 * 1024) == b"HTTP/1.1 413 Request Entity Too Large"  # > 8 MiB
        for path in (b"/v1/completions", b"/v1/chat/completions"):  # the worker's OpenAI API too
            assert declared_too_big(wp, 200 * 1024 * 1024, path) == b"HTTP/1.1 413 Request Entity Too Large"
        st, body = post(f"http://127.0.0.1:{wp}/v1/completions", {"prompt": prompt, "max_tokens": 1 << 20})
        assert st == 400 and "max_tokens" in body["error"]["message"], body
        worker = f"http://127.0.0.1:{wp}/generate"
        st, body = post(worker, {"token_ids": prompt, "max_tokens": 1 << 20})
        assert st == 422 and "max_tokens" in body["error"], body
        st, body = post(worker, {"token_ids": prompt, "max_tokens": 2, "arrival_s": 1e300})
        assert st == 422 and "arrival_s" in body["error"], body
        assert post(worker, {"token_ids": prompt, "max_tokens": 2})[0] == 200  # the schedule is intact
    finally:
        for c in (router, w, idx):
            if c is not None:
                c.stop()
