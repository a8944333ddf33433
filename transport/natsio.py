"""One NATS connection driven by an asyncio loop on a private thread (nats-py is asyncio-only).

Callers on ordinary threads hand coroutines to the loop (`call` waits for the result with a
deadline, `submit` returns a concurrent Future); nothing here sleeps to synchronise. The stream
helpers create or update the events stream from `schemas.jetstream.StreamSettings`
(docs/jetstream.md).

It lives in `schemas/` because it is the transport layer both halves share: the producer's
JetStream publisher and the indexer's JetStream subscriber import it, and neither imports the other.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from schemas.jetstream import StreamSettings

log = logging.getLogger(__name__)
T = TypeVar("T")


class NatsUnavailable(ConnectionError):
    """The NATS server could not be reached (URL in the message)."""


class NatsThread:
    """Owns a loop thread and one connection. `nc`/`js` are touched only on the loop."""

    __slots__ = ("url", "loop", "_thread", "nc", "js", "_closed", "reconnects", "errors", "error_listeners")

    def __init__(self, url: str, *, name: str = "kvatlas-nats", connect_timeout: float = 5.0) -> None:
        self.url = url
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._closed = False
        self.reconnects = 0
        self.errors = 0
        # Called on the loop with each asynchronous error (e.g. a slow consumer's drop); must not block.
        self.error_listeners: list[Callable[[Exception], None]] = []
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        try:
            self.nc = self.call(lambda: self._connect(name, connect_timeout), timeout=connect_timeout + 5)
        except Exception as exc:
            self._stop_loop()
            raise NatsUnavailable(f"cannot connect to NATS at {url!r}: {exc!r}") from exc
        self.js = self.nc.jetstream()

    async def _connect(self, name: str, connect_timeout: float) -> Client:
        async def on_error(exc: Exception) -> None:
            self.errors += 1
            n = self.errors
            if n & (n - 1) == 0 or n % 1000 == 0:  # a slow consumer reports every dropped message
                log.warning("nats %s: %r (%d errors so far)", self.url, exc, n)
            for listener in list(self.error_listeners):
                try:
                    listener(exc)
                except Exception:  # a listener bug must not break the connection's error path
                    log.exception("nats %s: error listener failed", self.url)

        async def on_reconnect() -> None:
            self.reconnects += 1
            log.info("nats %s: reconnected", self.url)

        return await nats.connect(self.url, name=name, connect_timeout=max(1, int(connect_timeout)),
                                  allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=0.25,
                                  error_cb=on_error, reconnected_cb=on_reconnect,
                                  pending_size=64 * 1024 * 1024)

    def submit(self, make: Callable[[], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        """Run `make()` on the loop; the coroutine is created there (it may touch `nc`)."""
        if self._closed:
            raise RuntimeError("NATS connection is closed")

        async def run() -> T:
            return await make()

        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    def call(self, make: Callable[[], Awaitable[T]], timeout: float = 10.0) -> T:
        """Run `make()` on the loop and wait for its result (raises its exception, or TimeoutError)."""
        async def run() -> T:
            return await make()

        fut = asyncio.run_coroutine_threadsafe(run(), self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"NATS operation did not finish within {timeout}s") from None

    def call_soon(self, fn: Callable[[], None]) -> None:
        self.loop.call_soon_threadsafe(fn)

    def close(self, timeout: float = 5.0) -> None:
        """Flush and close the connection, then stop the loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        nc = self.nc
        if nc is not None:
            async def shut() -> None:
                try:
                    await asyncio.wait_for(nc.flush(), timeout)
                except Exception as exc:  # closing anyway; say why the tail may be lost
                    log.warning("nats %s: flush at close failed: %r", self.url, exc)
                await nc.close()
            try:
                self.call(shut, timeout=timeout + 1)
            except Exception as exc:
                log.warning("nats %s: close failed: %r", self.url, exc)
        self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self.loop.close()


def stream_config(settings: StreamSettings) -> api.StreamConfig:
    return api.StreamConfig(
        name=settings.name,
        subjects=[settings.prefix + ".>"],
        retention=api.RetentionPolicy.LIMITS,
        max_age=settings.max_age_s if settings.max_age_s > 0 else None,
        max_bytes=settings.max_bytes if settings.max_bytes > 0 else None,
        duplicate_window=settings.duplicate_window_s,
        storage=api.StorageType.MEMORY if settings.storage == "memory" else api.StorageType.FILE,
        num_replicas=settings.replicas,
        allow_direct=True,
    )


async def ensure_stream(js: JetStreamContext, settings: StreamSettings, *, update: bool = True) -> api.StreamInfo:
    """Create the events stream; an existing one's limits are brought to `settings` when `update`
    (publishers and the relay own the limits; consumers only create a missing stream)."""
    if settings.storage not in ("file", "memory"):
        raise ValueError(f"stream storage must be 'file' or 'memory', got {settings.storage!r}")
    cfg = stream_config(settings)
    try:
        info = await js.stream_info(settings.name)
    except NotFoundError:
        return await js.add_stream(cfg)
    return await js.update_stream(cfg) if update else info
