"""Sending a trace's requests on its own clock: request i leaves at t0 + arrival_i / speed (wall
clock), each in a task of its own, so a slow answer never delays a later arrival."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

from router.trace import TraceRequest


async def send_paced(reqs: Sequence[TraceRequest], t0: float, speed: float,
                     send: Callable[[TraceRequest], Awaitable[None]],
                     on_done: Callable[[int], None] | None = None) -> None:
    """`send(r)` for every request at its paced time (`t0` on time.monotonic()); `on_done(n)` after
    each answer with the count so far. Returns once every request was answered."""
    done = 0

    async def one(r: TraceRequest) -> None:
        nonlocal done
        await send(r)
        done += 1
        if on_done is not None:
            on_done(done)

    tasks = []
    for r in reqs:
        delay = t0 + r.arrival_s / speed - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)  # pacing to the trace's clock
        tasks.append(asyncio.create_task(one(r)))
    await asyncio.gather(*tasks)
