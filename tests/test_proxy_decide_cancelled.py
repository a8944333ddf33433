"""The OpenAI proxy's indexer client when its client leaves mid-decide (issue 37, finding 13): the
`/routes/decide` call is cancelled after the indexer received it, so the indexer may have reserved the
route and applied the releases and admission reports riding on the call. All go out again with the next release batch
rather than being held until the indexer's TTL (the hostile proxy soak found 44 routes expired)."""
from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest

from router.proxy.indexer import IndexerClient
from router_api.decide import Candidate, DecideRequest, ReleaseRequest


def test_a_cancelled_decide_releases_its_route_and_the_riding_ones() -> None:
    async def main() -> list[ReleaseRequest]:
        decide_seen = asyncio.Event()
        released: list[ReleaseRequest] = []

        async def indexer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    size = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                                if line.lower().startswith(b"content-length:"))
                    body = await reader.readexactly(size)
                    if head.startswith(b"POST /routes/decide "):
                        decide_seen.set()  # received, never answered: the caller is cancelled meanwhile
                        await reader.read()
                        return
                    released.append(msgspec.msgpack.decode(body, type=ReleaseRequest))
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            finally:
                writer.close()

        server = await asyncio.start_server(indexer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with httpx.AsyncClient() as http:
            client = IndexerClient(f"http://127.0.0.1:{port}", http, None, release_every_s=3600.0)
            client.release("default", "finished-1")  # rides on the next decide
            client.admitted("default", "begun-1")     # so does an admission report
            req = DecideRequest("kvatlas-left", [Candidate("w0")], "default", tokens=b"\x01\x00\x00\x00")
            task = asyncio.get_running_loop().create_task(client.decide(req))
            await decide_seen.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await client.flush()
            await client.close()
        server.close()
        await server.wait_closed()
        return released

    released = asyncio.run(main())
    assert [r.request_ids for r in released] == [["finished-1", "kvatlas-left"]]
    assert [r.admitted for r in released] == [["begun-1"]]
