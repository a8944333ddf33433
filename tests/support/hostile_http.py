"""Hostile parties for the OpenAI proxy's soak (soak/test_soak_hostile_proxy.py): engines that are not
what they seem (one answers /metrics and never answers a request; one drips its /metrics a byte at a
time; one sends /metrics without end) and the clients that attack the proxy's front (huge chats, deep
JSON, bad template arguments, slow heads, idle connections, requests and streams abandoned midway)."""
from __future__ import annotations

import json
import socket
import socketserver
import threading
from collections import Counter

import httpx

METRICS = (b'vllm:num_requests_running{model_name="default"} 0\n'
           b'vllm:num_requests_waiting{model_name="default"} 0\n')


def _read_head(conn: socket.socket) -> bytes:
    """The request line and headers (the body, if any, is left unread)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(4096)
        if not chunk:
            return b""
        buf += chunk
    return buf


class FakeEngine:
    """A tiny TCP server shaped like an engine, per `mode`:
    - "hang": /metrics answers honestly (so the proxy thinks it up); any other request is accepted and
      never answered, until the caller hangs up (counted in `abandoned`);
    - "drip": /metrics sends its head, then one byte every 0.2 s, for ever;
    - "huge": /metrics announces 600 MB and sends it as fast as the reader takes it."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.stop = threading.Event()
        self.counts: Counter[str] = Counter()
        engine = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                engine._serve(self.request)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._srv.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._srv.server_address[1]}"
        self._thread = threading.Thread(target=self._srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(1.0)
        try:
            while not self.stop.is_set():
                try:
                    head = _read_head(conn)
                except socket.timeout:
                    continue
                if not head:
                    return
                metrics = head.startswith(b"GET /metrics ")
                self.counts["metrics" if metrics else "requests"] += 1
                if metrics and self.mode == "hang":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(METRICS), METRICS))
                    continue
                if metrics and self.mode == "drip":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n")
                    while not self.stop.wait(0.2):
                        conn.sendall(b"#")
                    return
                if metrics and self.mode == "huge":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 600000000\r\n\r\n")
                    chunk = b"# " + b"x" * 65_533 + b"\n"
                    conn.settimeout(5.0)
                    while not self.stop.is_set():
                        conn.sendall(chunk)
                        self.counts["huge_bytes"] += len(chunk)
                    return
                # a request: accepted, never answered; the caller's hang-up is the end
                while not self.stop.is_set():
                    try:
                        if not conn.recv(65536):
                            self.counts["abandoned"] += 1
                            return
                    except socket.timeout:
                        continue
        except OSError:  # the proxy cut it off (the deadline, the size cap): what is under test
            self.counts["cut"] += 1
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self._srv.shutdown()
        self._srv.server_close()


# --- the attacks on the proxy's front ----------------------------------------------------------------

def huge_chat(size: int) -> bytes:
    """A chat body of about `size` bytes: one long user message, streamed (the engine's answer begins
    once it has tokenized the chat, not after its long prefill: no first-byte deadline is at stake)."""
    words = ("kv cache block router " * (size // 22 + 1))[:size]
    return json.dumps({"model": "default", "max_tokens": 1, "stream": True,
                       "messages": [{"role": "user", "content": words}]}).encode()


def deep_json(depth: int) -> bytes:
    return b'{"model": "default", "messages": ' + b"[" * depth + b"]" * depth + b"}"


BAD_KWARGS = json.dumps({"model": "default", "max_tokens": 1, "chat_template_kwargs": ["not", "a", "dict"],
                         "messages": [{"role": "user", "content": "hi"}]}).encode()


def post_raw(port: int, path: str, body: bytes, *, send: int | None = None, read: int = 0,
             timeout: float = 30.0) -> bytes:
    """POST `body` on a fresh connection; send only its first `send` bytes (the client leaves midway),
    read up to `read` bytes of the answer (0: none), then close. What was read comes back."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        head = (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                % (path.encode(), len(body)))
        s.sendall(head + (body if send is None else body[:send]))
        got = b""
        while len(got) < read:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        return got


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


class ProxyAttacker(threading.Thread):
    """One attack in a loop until `stop`: `kind` is one of ATTACKS; `seen` counts the answers' statuses
    (0: none read), `errors` what went wrong on the attacker's side (the proxy refusing it is fine)."""

    ATTACKS = ("huge_chat", "deep_json", "bad_kwargs", "leave_mid_body", "leave_before_answer", "leave_mid_stream")

    def __init__(self, kind: str, port: int) -> None:
        super().__init__(daemon=True, name=f"attack-{kind}")
        assert kind in self.ATTACKS
        self.kind, self.port = kind, port
        self.stop = threading.Event()
        self.seen: Counter[int] = Counter()
        self.errors: list[str] = []
        self.sent = 0

    def one(self, i: int) -> None:
        p, chat = self.port, "/v1/chat/completions"
        if self.kind == "huge_chat":  # tokenized in the bounded pool (300k tokens); past the body cap (413)
            self.seen[status_of(post_raw(p, chat, huge_chat(9_000_000 if i % 2 else 1_000_000), read=12))] += 1
        elif self.kind == "deep_json":
            self.seen[status_of(post_raw(p, chat, deep_json(200_000), read=12))] += 1
        elif self.kind == "bad_kwargs":
            self.seen[status_of(post_raw(p, chat, BAD_KWARGS, read=12))] += 1
        elif self.kind == "leave_mid_body":
            post_raw(p, chat, huge_chat(200_000), send=100_000)
            self.seen[0] += 1
        elif self.kind == "leave_before_answer":  # a whole request, then gone: the engine's work is cancelled
            body = json.dumps({"model": "default", "max_tokens": 64, "messages": [
                {"role": "user", "content": f"abandoned {i}"}]}).encode()
            post_raw(p, chat, body)
            self.seen[0] += 1
        else:  # leave_mid_stream: read the first bytes of the stream, then hang up
            body = json.dumps({"model": "default", "max_tokens": 200, "stream": True, "messages": [
                {"role": "user", "content": f"streamed then abandoned {i}"}]}).encode()
            self.seen[status_of(post_raw(p, chat, body, read=200))] += 1

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            try:
                self.one(i)
                self.sent += 1
            except OSError as exc:
                self.errors.append(f"{self.kind}: {exc!r}")
                self.stop.wait(0.1)
            self.stop.wait(0.05)  # pacing: the attack is the shape of the request, not the rate


def idle_connections(port: int, n: int) -> list[socket.socket]:
    """n connections that send nothing at all."""
    return [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(n)]


def metric(text: str, name: str, label: str = "") -> float:
    """The sum of the series of /metrics `text` whose line starts with `name` and holds `label`."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name) and label in line)


def get_text(url: str) -> str:
    return httpx.get(url, timeout=10.0).text
