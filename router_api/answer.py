"""The `/score` answer bytes written in C (`write_answer` in indexer/_native/answer.c) from the index's
packed rows (`KVIndex.score_table`), instead of a `WorkerScoreOut` per row encoded by msgspec
(docs/service.md, "Answer bytes").

The bytes are msgspec's, exactly: every key and string (worker ids, model, status) is encoded here by
msgspec itself, once per registration or model, and the C writer only adds numbers (ints in msgspec's
smallest msgpack form or JSON digits; floats as msgpack float64 or msgspec's JSON spelling) and orders
the rows like `IndexerService.score` (fresh before stale, score descending, stable). A row's in-flight
fields (`pending_blocks` ... `busy_until`, docs/reference.md) come as two columns per head
(`score_plan.pending_columns`) and are written where set, as msgspec's omit_defaults leaves them.
`tests/test_score_answer.py` holds the two encodings equal over hypothesis-drawn scores, tiers,
statuses and names. Pure: no state beyond what the caller keeps.
"""
from __future__ import annotations

from array import array
from typing import Any, Sequence

import msgspec

from schemas.api import WORKER_STATUSES, BestWorker, ScoreResponse, TierBlocks, WorkerScoreOut
from schemas.rules import TIER_NAMES

_json = msgspec.json.Encoder()
_msgpack = msgspec.msgpack.Encoder()

# The shapes the layout below writes: a schema change turns the C writer off (the caller encodes with
# msgspec) until the layout follows it; the byte-equality tests fail meanwhile.
SUPPORTED = (
    ScoreResponse.__struct_fields__ == ("model", "block_size", "query_blocks", "workers", "best", "holders_only")
    and ScoreResponse.__struct_config__.omit_defaults
    and WorkerScoreOut.__struct_fields__ == ("worker_id", "dp_rank", "device_blocks", "cached_blocks", "tiers",
                                             "score", "stale", "last_seq", "status", "kv_blocks",
                                             "pending_blocks", "pending_requests", "pending_prefill_tokens",
                                             "busy_until")
    and WorkerScoreOut.__struct_config__.omit_defaults
    and TierBlocks.__struct_fields__ == TIER_NAMES
    and BestWorker.__struct_fields__ == ("worker_id", "dp_rank")
)


def _key(mp: bool, name: str, first: bool = False) -> bytes:
    """A map key as it precedes its value: msgpack `name`, JSON `,"name":` (no comma when first)."""
    if mp:
        return _msgpack.encode(name)
    return (b"" if first else b",") + _json.encode(name) + b":"


def layout(mp: bool, holders: bool = False) -> tuple[bytes, ...]:
    """The fixed pieces of the answer in `write_answer`'s order (its L_* enum); `holders`: the holders'
    answer's, which ends with `holders_only: true`."""
    enc = _msgpack.encode if mp else _json.encode
    k = lambda name, first=False: _key(mp, name, first)  # noqa: E731
    # kv_blocks (a hybrid worker's) and the in-flight fields are written only when set (omit_defaults): a
    # msgpack row opens with the 9 fields always present, and C raises the count by the others it writes
    row_fields = len(WorkerScoreOut.__struct_fields__) - 5
    return (
        bytes([0x80 | row_fields]) if mp else b"{",             # L_ROW_OPEN
        k("device_blocks"), k("cached_blocks"),
        k("tiers") + (b"\x84" if mp else b"{") + k("gpu", True),  # L_TIERS
        k("host"), k("disk"), k("shared"),
        (b"" if mp else b"}") + k("score"),                     # L_SCORE
        k("stale"), k("last_seq"), k("status"),
        b"" if mp else b"}",                                    # L_ROW_CLOSE
        k("workers") + (b"" if mp else b"["),                   # L_WORKERS (msgpack: C adds the array header)
        (b"" if mp else b"]") + k("best"),                      # L_AFTER
        (k("holders_only") + enc(True) if holders else b"") + (b"" if mp else b"}"),  # L_END
        b"\x82" if mp else b"{", b"" if mp else b"}",           # L_BEST_OPEN, L_BEST_CLOSE
        b"" if mp else b",",                                    # L_SEP
        enc(None), enc(True), enc(False),                       # L_NULL, L_TRUE, L_FALSE
        k("pending_blocks"), k("pending_requests"),             # L_PBLOCKS, L_PREQS
        k("pending_prefill_tokens"), k("busy_until"),           # L_PTOKENS, L_BUSY
        k("kv_blocks"),                                         # L_KV (a hybrid worker's row)
    )


def head(mp: bool, worker_id: str, dp_rank: int) -> bytes:
    """A row's first two pairs; the same bytes are the body of `best` (BestWorker)."""
    if mp:
        return _msgpack.encode(BestWorker(worker_id, dp_rank))[1:]  # without the map header
    return _json.encode(BestWorker(worker_id, dp_rank))[1:-1]  # without the braces


def prefix(mp: bool, model: str, block_size: int, holders: bool = False) -> bytes:
    """The answer up to the query_blocks value (`holders`: the holders' answer's, one field more)."""
    enc = _msgpack.encode if mp else _json.encode
    return ((b"\x86" if holders else b"\x85") if mp else b"{") + _key(mp, "model", True) + enc(model) + _key(mp, "block_size") \
        + enc(block_size) + _key(mp, "query_blocks")


def status_map(mp: bool) -> dict[str, tuple[bytes, bool]]:
    enc = _msgpack.encode if mp else _json.encode
    return {s: (enc(s), s == "stale") for s in WORKER_STATUSES}


class Formats:
    """The per-format constants (layout, status encodings) and a small per-model prefix cache."""

    __slots__ = ("layouts", "holder_layouts", "statuses", "_prefixes")

    def __init__(self) -> None:
        self.layouts = (layout(False), layout(True))
        self.holder_layouts = (layout(False, True), layout(True, True))
        self.statuses = (status_map(False), status_map(True))
        self._prefixes: dict[tuple[bool, str, int, bool], bytes] = {}

    def prefix(self, mp: bool, model: str, block_size: int, holders: bool = False) -> bytes:
        key = (mp, model, block_size, holders)
        p = self._prefixes.get(key)
        if p is None:
            if len(self._prefixes) > 64:  # models come and go: keep it bounded
                self._prefixes.clear()
            p = self._prefixes[key] = prefix(mp, model, block_size, holders)
        return p


class AnswerRows:
    """What `write_answer` reads per row, for one registry plan and one index order: the pre-encoded
    heads (JSON, msgpack) and each row's worker position in `states` (-1: not registered, skipped).
    Rows past the index's are the registered (worker, rank) pairs it does not hold (zero rows)."""

    __slots__ = ("worker_ids", "heads", "wix", "pairs")

    def __init__(self, worker_ids: list[str], heads: tuple[tuple[bytes, ...], tuple[bytes, ...]], wix: bytes,
                 pairs: list[tuple[str, int]]) -> None:
        self.worker_ids = worker_ids  # the index's list: while it is the same object, so is its order
        self.heads = heads
        self.wix = wix
        self.pairs = pairs  # (worker_id, dp_rank) per head: the in-flight columns' order

    @classmethod
    def build(cls, states: Sequence[Any], pairs: Sequence[tuple[str, int]], worker_ids: list[str],
              ranks: list[int]) -> "AnswerRows":
        pos = {w.worker_id: i for i, w in enumerate(states)}
        scored = list(zip(worker_ids, ranks))
        seen = set(scored)
        order = scored + [p for p in pairs if p not in seen]
        heads = (tuple(head(False, w, r) for w, r in order), tuple(head(True, w, r) for w, r in order))
        return cls(worker_ids, heads, array("i", [pos.get(w, -1) for w, _ in order]).tobytes(), order)
