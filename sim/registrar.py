"""`kvatlas worker`'s registration with an indexer, kept: registered once at start (the command
waits for it and stops on a refusal), then checked every `interval_s` by a thread: `GET
/workers/{id}` answering 404 — an indexer restarted without a snapshot, or one that expired us —
is answered with the registration again. One small GET per interval and worker; no sleep
synchronises anything (the check is a heartbeat: an indexer that forgot us sees us again within
one interval of being back). docs/reference.md, "Workers".
"""
from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

log = logging.getLogger("kvatlas.worker")

# Seconds between checks: an indexer restart is answered within this (plus the indexer's own start).
REGISTER_INTERVAL_S = 2.0


class RegistrationRefused(Exception):
    """The indexer answered the registration with an error (`status`, and its message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status} {message}")
        self.status = status


class Registrar:
    """Keeps one worker registered with one indexer (`register` once, then `start` the checks)."""

    __slots__ = ("url", "body", "token", "interval_s", "reregistrations", "_stop", "_thread", "_last")

    def __init__(self, url: str, body: dict[str, Any], token: str | None = None,
                 interval_s: float = REGISTER_INTERVAL_S) -> None:
        self.url = url.rstrip("/")
        self.body = body
        self.token = token
        self.interval_s = interval_s
        self.reregistrations = 0  # registrations after the first (an indexer that forgot us)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last = "registered"  # the last check's outcome: each is logged when it starts

    # -- HTTP ----------------------------------------------------------------------------------
    def _request(self, method: str, path: str, data: bytes | None = None) -> tuple[int, bytes]:
        """(status, body) of one request; OSError when the indexer cannot be reached."""
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def _post(self) -> None:
        status, body = self._request("POST", "/workers", json.dumps(self.body).encode())
        if status >= 300:
            raise RegistrationRefused(status, body.decode(errors="replace"))

    def _mine(self, row: dict[str, Any]) -> bool:
        """Whether the indexer's row is this registration (not another process's under our id)."""
        return all(row.get(k) == v for k, v in self.body.items() if k != "worker_id")

    # -- the first registration ----------------------------------------------------------------
    def register(self, timeout: float = 60.0) -> None:
        """POST /workers until the indexer answers (it may start after us); RegistrationRefused on
        a refusal, OSError past `timeout` unreachable. A 409 for our own identical registration (a
        restored snapshot already holds it) counts as registered."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            try:
                try:
                    self._post()
                except RegistrationRefused as exc:
                    if exc.status != 409 or not self._still_mine():
                        raise
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
            self._stop.wait(delay)  # retry pacing while the indexer starts (not a synchronisation)
            delay = min(1.0, delay * 2)

    def _still_mine(self) -> bool:
        status, body = self._request("GET", "/workers/" + urllib.parse.quote(self.body["worker_id"], safe=""))
        try:
            return status == 200 and self._mine(json.loads(body))
        except ValueError:
            return False

    # -- the checks ----------------------------------------------------------------------------
    def check(self) -> str:
        """One check: "registered", "reregistered", "refused", "foreign" (another registration
        holds our id), "failed" (an unexpected answer) or "unreachable". Each outcome but
        "reregistered" is logged when it starts, not at every check."""
        wid = self.body["worker_id"]
        detail = ""
        try:
            status, body = self._request("GET", "/workers/" + urllib.parse.quote(wid, safe=""))
            if status == 200:
                outcome = "registered" if self._mine(json.loads(body)) else "foreign"
            elif status == 404:
                self._post()
                outcome = "reregistered"
            else:
                outcome, detail = "failed", f"status {status}"
        except RegistrationRefused as exc:
            outcome, detail = "refused", str(exc)
        except (OSError, ValueError) as exc:
            outcome, detail = "unreachable", str(exc)
        if outcome == "reregistered":
            self.reregistrations += 1
            log.warning("event=reregistered worker=%s indexer=%s: the indexer had forgotten this worker", wid, self.url)
        elif outcome != self._last:
            if outcome == "registered":
                log.info("event=registration_ok worker=%s indexer=%s", wid, self.url)
            elif outcome == "foreign":
                log.error("event=registration_taken worker=%s indexer=%s: another registration holds this id", wid,
                          self.url)
            else:
                log.warning("event=registration_%s worker=%s indexer=%s %s", outcome, wid, self.url, detail)
        self._last = outcome
        return outcome

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvatlas-registrar", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):  # the heartbeat's period
            self.check()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
