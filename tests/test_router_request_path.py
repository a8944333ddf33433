"""The router's per-request shortcuts keep what they replace: the token array, the request ids, the
short-piece cache of the chat tokenizer."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st
from tokenizers import Tokenizer

import router_api.tokenization as tokenization
from router.proxy.core import ProxyCore, _u32
from router_api.tokenization import ChatTokenizer
from support.tiny_tokenizer import TINY_CHAT

RAW = Tokenizer.from_file(str(TINY_CHAT / "tokenizer.json"))


@given(st.lists(st.integers(0, (1 << 32) - 1), max_size=300))
def test_token_array_equals_numpys(ids: list[int]) -> None:
    got = _u32(ids)
    want = np.asarray(ids, dtype="<u4")
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


def test_request_ids_are_unique_within_and_across_routers() -> None:
    a = ProxyCore({"w": "http://127.0.0.1:1"}, indexer=None, model="m", tokenizer=None, policy="round_robin")
    b = ProxyCore({"w": "http://127.0.0.1:1"}, indexer=None, model="m", tokenizer=None, policy="round_robin")
    ids = [f"{c._id_prefix}{next(c._id_seq):016x}" for c in (a, b) for _ in range(1000)]
    assert len(set(ids)) == 2000
    assert all(i.startswith("kvatlas-") and len(i) == len("kvatlas-") + 32 for i in ids)


def test_short_piece_cache_is_bounded_and_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenization, "MAX_SHORT_PIECES", 4)
    t = ChatTokenizer(RAW, {"bos_token": "<s>"})
    assert t.segmentable
    texts = [f"<s>{w}\n<s>" for w in ("a", "bb", "ccc", "dd d", "e e e", "a", "bb")]
    for _ in range(2):
        for text in texts:
            assert t.encode_text(text, add_special_tokens=False) == RAW.encode(text, add_special_tokens=False).ids
            assert len(t._short) <= 4
