"""`/score` and `EmbeddedIndexer.score` with `prompt` / chat `messages`: the same answer as the token ids
the engine would make of them (chat template with BOS, special tokens and a generation prompt), the
token count echoed, and clear errors for a model without a tokenizer or an ambiguous request."""
from __future__ import annotations

import threading

import msgspec
import pytest

from producer.page_hash import page_ids
from producer.publisher import ZmqEventPublisher
from router_api.embedded import EmbeddedIndexer
from router_api.score_text import TextInputError
from router_api.config import ServiceConfig
from router_api.tokenization import ChatTokenizer
from schemas.api import TextScoreResponse
from schemas.events import BlockStored
from support.net import free_port, wait_until
from support.service import LiveIndexer
from support.tiny_tokenizer import TINY_CHAT

BS = 4
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer the question briefly and precisely."}
CHAT = [SYSTEM, {"role": "user", "content": "What is the capital of France?"}]
TOK = ChatTokenizer.from_dir(TINY_CHAT)


def _stored(tokens: list[int]) -> BlockStored:
    n = len(tokens) // BS * BS
    return BlockStored(block_hashes=page_ids(tokens[:n], BS), parent_block_hash=None, token_ids=tokens[:n],
                       block_size=BS, medium="GPU")


def _rows(answer: dict) -> list[tuple]:
    return [(r["worker_id"], r["device_blocks"], r["cached_blocks"]) for r in answer["workers"]]


def test_score_messages_equals_score_of_template_ids() -> None:
    chat_ids = TOK.encode_chat(CHAT)
    assert chat_ids[0] == TOK.tokenizer.token_to_id("<s>")
    # the worker holds the system part only: a partial match, not all-or-nothing
    system_ids = TOK.encode_chat([SYSTEM], add_generation_prompt=False)
    assert chat_ids[:len(system_ids)] == system_ids
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    cfg = ServiceConfig(port=free_port(), block_size=BS, stale_after_s=600, remove_after_s=3600,
                        tokenizers={"default": str(TINY_CHAT)})
    with LiveIndexer(cfg) as idx:
        c = idx.client
        assert c.post("/workers", json={"worker_id": "w0", "endpoint": pub.endpoint,
                                        "replay_endpoint": pub.replay_endpoint, "block_size": BS}).status_code == 201
        want_blocks = len(system_ids) // BS

        def held() -> bool:
            pub.publish([_stored(system_ids)])
            return c.post("/score", json={"token_ids": chat_ids}).json()["workers"][0]["cached_blocks"] == want_blocks
        wait_until(held, timeout=15)
        by_ids = c.post("/score", json={"token_ids": chat_ids}).json()
        by_chat = c.post("/score", json={"messages": CHAT}).json()
        assert by_chat["prompt_tokens"] == len(chat_ids)
        assert _rows(by_chat) == _rows(by_ids) and by_chat["query_blocks"] == by_ids["query_blocks"]
        assert by_chat["best"] == by_ids["best"] == {"worker_id": "w0", "dp_rank": 0}
        # msgpack in and out
        mp = c.post("/score", content=msgspec.msgpack.encode({"messages": CHAT}),
                    headers={"Content-Type": "application/msgpack", "Accept": "application/msgpack"})
        assert _rows(msgspec.msgpack.decode(mp.content)) == _rows(by_ids)
        # without the generation prompt: fewer tokens, still the template's ids
        no_gen = c.post("/score", json={"messages": CHAT, "add_generation_prompt": False}).json()
        assert no_gen["prompt_tokens"] == len(TOK.encode_chat(CHAT, add_generation_prompt=False)) < len(chat_ids)
        # a completions prompt: the post-processor's BOS
        text = "You are a helpful assistant."
        p = c.post("/score", json={"prompt": text}).json()
        assert p["prompt_tokens"] == len(TOK.encode_prompt(text)) == len(TOK.tokenizer.encode(text).ids)
        # errors
        both = c.post("/score", json={"messages": CHAT, "token_ids": chat_ids})
        assert both.status_code == 422 and "exactly one" in both.json()["error"]
        assert c.post("/score", json={"model": "default"}).status_code == 422
        other = c.post("/score", json={"messages": CHAT, "model": "other"})
        assert other.status_code == 422 and "no tokenizer configured for model 'other'" in other.json()["error"]
        bad = c.post("/score", json={"messages": [{"content": "no role"}]})
        assert bad.status_code == 400 and "role" in bad.json()["error"]
        # plain token_ids answers are unchanged (no prompt_tokens)
        assert "prompt_tokens" not in by_ids
    pub.close()


def test_embedded_score_messages() -> None:
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    ids = TOK.encode_chat(CHAT)
    spec = [{"worker_id": "w0", "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}]
    with EmbeddedIndexer(spec, block_size=BS, stale_after_s=600, remove_after_s=3600, tokenizers={"default": str(TINY_CHAT)}) as idx:
        def held() -> bool:
            pub.publish([_stored(ids)])
            return idx.score(ids).workers[0].cached_blocks == len(ids) // BS
        wait_until(held, timeout=15)
        res = idx.score(messages=CHAT)
        assert isinstance(res, TextScoreResponse) and res.prompt_tokens == len(ids)
        assert res.workers == idx.score(ids).workers
        with pytest.raises(TextInputError, match="exactly one"):
            idx.score(ids, prompt="x")
        with pytest.raises(TextInputError, match="no tokenizer"):
            idx.score(prompt="x", model="nope")
    pub.close()
    with EmbeddedIndexer([], block_size=BS) as bare, pytest.raises(TextInputError, match="--tokenizer"):
        bare.score(messages=CHAT)


def test_embedded_wait_live() -> None:
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    spec = [{"worker_id": "w0", "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}]
    try:
        with EmbeddedIndexer(spec, block_size=BS, stale_after_s=600, remove_after_s=3600) as idx:
            with pytest.raises(TimeoutError, match=r"w0 \(connecting\)"):
                idx.wait_live(timeout_s=0.2)  # nothing published yet
            # heartbeats until the subscription hears one (a PUB drops what it sends before the SUB connects)
            stop = threading.Event()
            beats = threading.Thread(target=lambda: [pub.heartbeat() for _ in iter(lambda: stop.wait(0.05), True)])
            beats.start()
            try:
                rows = idx.wait_live(timeout_s=20)
            finally:
                stop.set()
                beats.join(5)
            assert [w.status for w in rows.workers] == ["live"]
    finally:
        pub.close()
