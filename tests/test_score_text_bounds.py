"""Text `/score` within the same bounds as token ids (issue 37, finding 8): a prompt that becomes more
than MAX_QUERY_TOKENS tokens is refused like a token list that long, and text requests, whatever their
size, are tokenized on the answer pool (off the event loop), one at a time."""
from __future__ import annotations

import time
from concurrent.futures import Future

from router_api.config import ServiceConfig
from schemas.api import MAX_QUERY_TOKENS
from support.net import free_port
from support.service import LiveIndexer
from support.tiny_tokenizer import TINY_CHAT


def _cfg() -> ServiceConfig:
    return ServiceConfig(port=free_port(), block_size=4, tokenizers={"default": str(TINY_CHAT)})


def test_text_over_the_token_cap_is_refused() -> None:
    with LiveIndexer(_cfg()) as idx:
        r = idx.client.post("/score", json={"prompt": "ab" * (MAX_QUERY_TOKENS // 2 + 1)}, timeout=120)
        assert r.status_code == 413 and "token" in r.json()["error"], r.text[:300]
        assert idx.client.post("/score", json={"prompt": "ab" * 100}).status_code == 200
        assert 'reason="too_long"' in idx.client.get("/metrics").text


def test_a_small_text_request_is_answered_off_the_loop() -> None:
    with LiveIndexer(_cfg()) as idx:
        from router_api.fasthttp import find_front

        front = find_front(idx.app)
        assert front is not None
        route = front.routes["/score"]
        got = front.dispatch(route, "json", None, b"", b'{"prompt": "hello there"}', time.perf_counter())
        assert isinstance(got, Future)  # the pool answers it, not the loop's thread
        status, body, _ = got.result(30)
        assert status == 200 and b"prompt_tokens" in body
        small_ids = front.dispatch(route, "json", None, b"", b'{"token_ids": [1, 2, 3, 4]}', time.perf_counter())
        assert not isinstance(small_ids, Future) and small_ids[0] == 200  # token ids stay on the loop


def test_text_requests_are_tokenized_one_at_a_time() -> None:
    with LiveIndexer(_cfg()) as idx:
        from router_api.fasthttp import find_front

        front = find_front(idx.app)
        assert front is not None
        front.pool.text_slots.acquire()  # one text request being tokenized
        try:
            r = idx.client.post("/score", json={"prompt": "hello there"})
            assert r.status_code == 503 and "busy" in r.json()["error"]
            assert idx.client.post("/score", json={"token_ids": [1, 2, 3, 4]}).status_code == 200
        finally:
            front.pool.text_slots.release()
        assert idx.client.post("/score", json={"prompt": "hello there"}).status_code == 200


def test_a_long_text_is_tokenized_without_holding_the_gil() -> None:
    """A million-token prompt must not stop the other threads (the event loop among them) for its
    whole tokenization: the main thread keeps running while a thread tokenizes it."""
    import threading

    from router_api.tokenization import ChatTokenizer

    tok = ChatTokenizer.from_dir(TINY_CHAT)
    text = "hello world " * 150_000
    done = threading.Event()
    got: list[int] = []
    worker = threading.Thread(target=lambda: (got.append(len(tok.encode_prompt(text))), done.set()))
    worker.start()
    turns = 0
    while not done.is_set():
        time.sleep(0.001)  # each turn needs the GIL back
        turns += 1
    worker.join()
    assert got == [900_002]
    assert turns >= 50, turns
