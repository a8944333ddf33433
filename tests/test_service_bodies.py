"""/score and /query request bodies: the native u32 decoder (raw `token_ids` parsed in C) against the
pure-Python typed msgspec decoder. Three real uvicorn servers front one live service fed by a real ZMQ
publisher — one app decodes bodies natively, one with the Python path, one natively behind the
uvicorn protocol fast path (router_api.fasthttp) — and random valid and invalid JSON / msgpack
bodies must get the same status and the same response bytes from all three."""
from __future__ import annotations

import struct
import threading
from typing import Iterator

import httpx
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.net import free_port, wait_until
from indexer.core import native as native_core
from producer.publisher import ZmqEventPublisher
from router_api.app import create_app
from router_api.bodies import TokenBodies
from router_api.config import ServiceConfig
from schemas.api import MAX_QUERY_TOKENS, QueryRequest, ScoreRequest
from support.service import LiveIndexer, WorkerSim, make_prompts, wait_applied

pytestmark = pytest.mark.skipif(not native_core.available(), reason="native module not built")

BS = 4
U32 = 2 ** 32


class Pair:
    """The live service on two servers: `native` (default app) and `pure` (Python body decoder)."""

    __slots__ = ("live", "server", "thread", "pure", "native", "sims", "fast_server", "fast_thread", "fast")

    def __init__(self) -> None:
        import uvicorn

        from cli.indexer import server_settings

        cfg = ServiceConfig(port=free_port(), block_size=BS, stats_ttl_s=0.0, stale_after_s=3600.0,
                            remove_after_s=7200.0)
        self.live = LiveIndexer(cfg).start()
        port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(
            create_app(self.live.service, native_bodies=False), host="127.0.0.1", port=port,
            log_level="warning", access_log=False, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-pure", daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, timeout=10)
        self.native = self.live.client
        self.pure = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0)
        fport = free_port()
        self.fast_server = uvicorn.Server(uvicorn.Config(create_app(self.live.service),
                                                         **server_settings("127.0.0.1", fport)))
        self.fast_thread = threading.Thread(target=self.fast_server.run, name="uvicorn-fast", daemon=True)
        self.fast_thread.start()
        wait_until(lambda: self.fast_server.started, timeout=10)
        self.fast = httpx.Client(base_url=f"http://127.0.0.1:{fport}", timeout=10.0)
        self.sims: dict[str, WorkerSim] = {}

    def close(self) -> None:
        self.pure.close()
        self.fast.close()
        for server, thread in ((self.server, self.thread), (self.fast_server, self.fast_thread)):
            server.should_exit = True
            thread.join(10)
        self.live.stop()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    p = Pair()
    pubs = {}
    try:
        prompts = make_prompts(11, BS)
        for i in range(2):
            ep, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            wid = f"body-w{i}"
            pubs[wid] = pub = ZmqEventPublisher(ep, replay_endpoint=rep)
            r = p.native.post("/workers", json={"worker_id": wid, "endpoint": ep, "replay_endpoint": rep,
                                                "block_size": BS})
            assert r.status_code == 201, r.text
            p.sims[wid] = sim = WorkerSim(200 + i, BS, prompts)
            for _ in range(40):
                pub.publish(sim.step())
            pub.flush(5)
        wait_applied(p.native, {wid: 39 for wid in p.sims}, pubs=pubs)
        yield p
    finally:
        for pub in pubs.values():
            pub.close()
        p.close()


def _same(p: Pair, path: str, body: bytes, ctype: str) -> httpx.Response:
    h = {"content-type": ctype}
    a = p.native.post(path, content=body, headers=h)
    b = p.pure.post(path, content=body, headers=h)
    c = p.fast.post(path, content=body, headers=h)
    assert (a.status_code, a.content) == (b.status_code, b.content), (path, body[:200], a.text, b.text)
    assert (a.status_code, a.content) == (c.status_code, c.content), (path, body[:200], a.text, c.text)
    return a


# --- body strategies ---------------------------------------------------------------------------

# Token spellings msgspec judges in ways a hand parser could get wrong: floats, exponents, booleans,
# signs, leading zeros, big ints, strings, nesting.
ODD_JSON = ["1.0", "1e3", "1E3", "0.5", "-0", "-1", "01", "00", "true", "false", "null", '"7"', "[1]",
            "{}", "4294967296", "4294967295", "18446744073709551616", "99999999999999999999999", "-4294967295",
            "1.", ".5", "+1", "0x10", "NaN", "Infinity", "1e-3"]
WS = st.sampled_from(["", " ", "\n", "\t", "\r\n ", "  "])


VALID_U32 = st.integers(0, U32 - 1) | st.sampled_from([0, 1, 127, 128, 255, 256, 65535, 65536, U32 - 1])
# Most arrays are valid; the rest hold one or two odd elements among valid ones, so each odd
# spelling is met often in an otherwise well-formed body.
N_ODD = st.sampled_from([0, 0, 0, 1, 1, 1, 2])


@st.composite
def json_token_arrays(draw: st.DrawFn) -> bytes:
    items = [str(v) for v in draw(st.lists(VALID_U32, max_size=30))]
    for _ in range(draw(N_ODD)):
        items.insert(draw(st.integers(0, len(items))), draw(st.sampled_from(ODD_JSON)))
    out = "[" + draw(WS)
    for i, it in enumerate(items):
        out += it + draw(WS) + ("," + draw(WS) if i < len(items) - 1 else "")
    out += draw(st.sampled_from(["]"] * 12 + [",]", "", "]]"]))
    return out.encode()


def _mp_int(v: int, form: str) -> bytes:
    """One msgpack int, minimal or in a wider / signed encoding (all valid msgpack)."""
    if form == "min":
        return msgspec.msgpack.encode(v)
    code, fmt = {"u16": (0xCD, ">H"), "u32": (0xCE, ">I"), "u64": (0xCF, ">Q"),
                 "i32": (0xD2, ">i"), "i64": (0xD3, ">q")}[form]
    try:
        return bytes([code]) + struct.pack(fmt, v)
    except struct.error:
        return msgspec.msgpack.encode(v)


ODD_MP = [msgspec.msgpack.encode(x) for x in (1.0, 0.0, True, False, None, "7", [1], {"a": 1}, b"\x01",
                                              -1, -(2 ** 63), U32, 2 ** 64 - 1)] + [b"\xc1", b"\xd4\x01\x00"]


@st.composite
def msgpack_token_arrays(draw: st.DrawFn) -> bytes:
    forms = st.sampled_from(["min", "min", "min", "u16", "u32", "u64", "i32", "i64"])
    elems = [_mp_int(v, draw(forms)) for v in draw(st.lists(VALID_U32, max_size=30))]
    for _ in range(draw(N_ODD)):
        elems.insert(draw(st.integers(0, len(elems))), draw(st.sampled_from(ODD_MP)))
    n = len(elems)
    head = draw(st.sampled_from(["fix", "16", "32"])) if n < 16 else draw(st.sampled_from(["16", "32"]))
    hdr = {"fix": bytes([0x90 | n]), "16": b"\xdc" + struct.pack(">H", n), "32": b"\xdd" + struct.pack(">I", n)}[head]
    body = hdr + b"".join(elems)
    cut = draw(st.sampled_from([0] * 12 + [1]))  # sometimes truncated
    return body[: len(body) - cut] if cut and body else body


GOOD_FIELDS = st.fixed_dictionaries({}, optional={
    "model": st.just("default"), "lora_name": st.sampled_from([None, "adapter-x"]),
    "cache_salt": st.sampled_from([None, "tenant-1"]), "model_name": st.sampled_from([None, "default"]),
    "colour": st.just("red"),
})
BAD_FIELDS = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["nope", "", 5]), "lora_name": st.just("a" * 300),
    "model_name": st.sampled_from(["nope", 7]),
})
OTHER_FIELDS = st.one_of(GOOD_FIELDS, GOOD_FIELDS, GOOD_FIELDS, BAD_FIELDS)


def _wrap(encode: type, raw: bytes, extra: dict, tokens_first: bool) -> bytes:
    items = [("token_ids", msgspec.Raw(raw))] + list(extra.items())
    if not tokens_first:
        items.reverse()
    return encode(dict(items))


def _mutate(body: bytes, how: int) -> bytes:
    """Sometimes break the whole body: truncate it or flip a byte."""
    if how == 1 and len(body) > 2:
        return body[: len(body) // 2]
    if how == 2 and body:
        i = len(body) // 3
        return body[:i] + bytes([body[i] ^ 0x5A]) + body[i + 1:]
    return body


SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


CODECS = {"json": (json_token_arrays, msgspec.json.encode, "application/json"),
          "msgpack": (msgpack_token_arrays, msgspec.msgpack.encode, "application/msgpack")}


@settings(SETTINGS, max_examples=240)  # both codecs: as many examples as the two tests they replace
@given(data=st.data(), codec=st.sampled_from(sorted(CODECS)), extra=OTHER_FIELDS, first=st.booleans(),
       how=st.sampled_from([0] * 10 + [1, 2]), path=st.sampled_from(["/score", "/query"]))
def test_json_and_msgpack_bodies_answer_identically(pair: Pair, data: st.DataObject, codec: str, extra: dict,
                                                    first: bool, how: int, path: str) -> None:
    arrays, encode, ctype = CODECS[codec]
    raw = data.draw(arrays(), label="token array")
    body = _mutate(_wrap(encode, raw, extra, first), how)
    _same(pair, path, body, ctype)


def test_hits_and_limits_answer_identically(pair: Pair) -> None:
    """Queries that hit cached prefixes give the expected scores on both; the token-count limit and
    the value bounds are the same 422 on both, with the same message."""
    sim = next(iter(pair.sims.values()))
    hits = 0
    for q in sim.sample_queries(10):
        for enc, ctype in ((msgspec.json.encode, "application/json"), (msgspec.msgpack.encode, "application/msgpack")):
            r = _same(pair, "/score", enc({"token_ids": q}), ctype)
            assert r.status_code == 200
            body = r.json()
            assert body["query_blocks"] == len(q) // BS
            got = {w["worker_id"]: w["cached_blocks"] for w in body["workers"]}
            assert got == {wid: s.expect(q)["cached_blocks"] for wid, s in pair.sims.items()}
            hits += body["workers"][0]["cached_blocks"] > 0
    assert hits >= 4
    too_many = b'{"token_ids": [' + b"1," * MAX_QUERY_TOKENS + b"1]}"
    r = _same(pair, "/score", too_many, "application/json")
    assert r.status_code == 422 and "2000000" in r.json()["error"]
    mp_many = b"\x81\xa9token_ids\xdd" + struct.pack(">I", MAX_QUERY_TOKENS + 1) + b"\x01" * (MAX_QUERY_TOKENS + 1)
    r = _same(pair, "/score", mp_many, "application/msgpack")
    assert r.status_code == 422 and "2000000" in r.json()["error"]
    for bad in (b'{"token_ids": [1, 4294967296]}', b'{"token_ids": [1, -1]}', b'{"token_ids": [1.0]}',
                b'{"token_ids": [true]}', b'{"token_ids": [1e3]}'):
        r = _same(pair, "/score", bad, "application/json")
        assert r.status_code == 422 and "token_ids" in r.json()["error"], r.text


def test_native_decoder_returns_u32_buffers_equal_to_the_typed_lists() -> None:
    """The fast path really is taken for plain bodies (a u32 array, not a list), and its tokens equal
    the typed decoder's; odd input falls through to the typed decoder's list."""
    fast, slow = TokenBodies(True), TokenBodies(False)
    assert fast.native is not None and slow.native is None
    toks = [0, 1, 127, 128, 65535, 65536, U32 - 1] * 50
    for kind, enc in (("json", msgspec.json.encode), ("msgpack", msgspec.msgpack.encode)):
        for typ, extra in ((ScoreRequest, {"model": "m", "lora_name": "l"}), (QueryRequest, {"model_name": "m"})):
            body = enc({"token_ids": toks, **extra})
            req_f, t_f = fast.decode(kind, body, typ)
            req_s, t_s = slow.decode(kind, body, typ)
            assert isinstance(t_f, np.ndarray) and t_f.dtype == np.dtype("<u4") and isinstance(t_s, list)
            assert t_f.tolist() == t_s == toks
            assert req_f.lora_name == req_s.lora_name and getattr(req_f, "model_name", None) == getattr(req_s, "model_name", None)
        empty_f = fast.decode(kind, enc({"token_ids": []}), ScoreRequest)[1]
        assert isinstance(empty_f, np.ndarray) and empty_f.size == 0
    odd = fast.decode("json", b'{"token_ids": [1, -0, 2]}', ScoreRequest)[1]
    assert odd == [1, 0, 2]  # msgspec reads -0 as 0; the typed decoder answered


def test_pure_python_switch_selects_the_typed_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native_core.ENV_PURE, "1")
    assert TokenBodies().native is None
    req, toks = TokenBodies().decode("json", b'{"token_ids": [3, 4]}', ScoreRequest)
    assert toks == [3, 4] and req.model == "default"
    monkeypatch.setenv(native_core.ENV_PURE, "0")
    assert TokenBodies().native is not None


def _judged(tb: TokenBodies, body: bytes, typ: type) -> object:
    from router_api.bodies import ApiError

    try:
        req, toks = tb.decode("json", body, typ)
    except ApiError as exc:
        return ("error", exc.status, exc.message)
    fields = {f: getattr(req, f) for f in req.__struct_fields__ if f != "token_ids"}
    return ("ok", None if toks is None else list(np.asarray(toks).tolist()), fields)  # None: no token_ids (a prompt / messages body)


def test_one_pass_json_body_parse_agrees_with_the_typed_decoder() -> None:
    """The C scan that finds `token_ids` in a whole JSON body (then the typed decoder judges the
    rest) against the typed decoder alone, on bodies built to mislead a scanner."""
    fast, slow = TokenBodies(True), TokenBodies(False)
    bodies = [
        b'{"token_ids": [1, 2, 3]}', b' {"model":"default" , "token_ids":[7] } ', b'{"token_ids":[]}',
        b'{"model": "a\\"token_ids\\":[9]", "token_ids": [1]}', b'{"model": "x\\\\", "token_ids": [2]}',
        b'{"x": {"token_ids": [5]}, "token_ids": [6]}', b'{"x": ["token_ids", [5]], "token_ids": [6]}',
        b'{"token_ids": [1], "token_ids": [2]}', b'{"token_\\u0069ds": [1]}', b'{"token_ids": [1], "token_\\u0069ds": [2]}',
        b'{"token_ids": [1],}', b'{"token_ids": [1]} x', b'{"token_ids": [1]', b'{"token_ids" [1]}', b'{}', b'[]',
        b'{"token_ids": [1], "model": 5}', b'{"token_ids": [1], "lora_name": null, "cache_salt": "s"}',
        b'{"colour": [1, {"a": "}"}], "token_ids": [3]}', b'{"token_ids": [01]}', b'{"token_ids": [4294967296]}',
        b'{"model": "default", "model": "other", "token_ids": [1]}', b'{"token_ids": [1], "x": tru}',
        b'{"token_ids": [1], "x": "\x01"}', b'{"token_ids": [1]}\n', b'\t{"token_ids":\n[1,\n2]}\r\n',
    ]
    for typ in (ScoreRequest, QueryRequest):
        for body in bodies:
            assert _judged(fast, body, typ) == _judged(slow, body, typ), body


@settings(max_examples=300, deadline=None)
@given(raw=json_token_arrays(), extra=OTHER_FIELDS, first=st.booleans(), cut=st.integers(0, 400),
       flip=st.integers(0, 400), junk=st.binary(max_size=8))
def test_one_pass_json_parse_on_mangled_bodies(raw: bytes, extra: dict, first: bool, cut: int, flip: int,
                                               junk: bytes) -> None:
    """Random damage anywhere in a body (cut, flipped byte, junk spliced in): never a crash, and the
    same judgement as the typed decoder alone."""
    body = _wrap(msgspec.json.encode, raw, extra, first)
    body = body[: max(1, len(body) - cut % 3)]
    if body:
        i = flip % len(body)
        body = body[:i] + junk + body[i + (1 if junk else 0):]
    fast, slow = TokenBodies(True), TokenBodies(False)
    for typ in (ScoreRequest, QueryRequest):
        assert _judged(fast, body, typ) == _judged(slow, body, typ), body
