"""The producer's C event encoder takes its tag, field names, field order and map sizes from
schemas/ through a generated header (producer/_native/event_tables.py, docs/producer-events.md):
the committed header is what the generator writes today, the built module reports the same
tables, and a build from other schemas is refused (the pure path serves)."""
from __future__ import annotations

import msgspec
import pytest

from producer import page_hash as ph
from producer._native import event_tables
from schemas import events as E


def _mod():
    if ph._native is None:
        pytest.fail(f"producer._native._pagehash is not built ({ph.native_unavailable_reason()})")
    return ph._native


def test_committed_header_is_generated_from_schemas() -> None:
    assert event_tables.HEADER.read_text() == event_tables.render(), (
        "run: python -m producer._native.event_tables --write")


def test_built_module_reports_the_schema_tables() -> None:
    assert _mod().event_tables() == event_tables.tables()


def test_tables_follow_the_schema_sources() -> None:
    t = event_tables.tables()
    assert t["stored_fields"] == E.BlockStored.__struct_fields__
    assert t["removed_fields"] == E.BlockRemoved.__struct_fields__
    assert t["tags"] == ("BlockStored", "BlockRemoved", "AllBlocksCleared")
    # the tag key and the map header class are what msgspec writes
    raw = msgspec.msgpack.encode(E.BlockRemoved([1]))
    assert raw[0] == 0x80 | 2 and t["map_keys"][1] < 16
    assert msgspec.msgpack.decode(raw) == {t["tag_field"]: "BlockRemoved", "block_hashes": [1]}
    assert msgspec.msgpack.encode(E.BlockStored([1], None, [], 1))[0] == 0xde and t["map_keys"][0] >= 16


def test_drift_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """A schema change the header does not have (here: a field added to BlockRemoved) makes the
    drift test fail and the import check refuse the built module."""
    _mod()

    class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
        block_hashes: list[E.BlockHash]
        medium: str | None = None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None
        priority: int | None = None

    monkeypatch.setattr(E, "BlockRemoved", BlockRemoved)
    assert event_tables.HEADER.read_text() != event_tables.render()
    mod, reason = ph._load_native()
    assert mod is None and reason is not None and "other schemas" in reason


def test_a_field_the_encoder_writes_cannot_move(monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoder writes its fields in declaration order: a schema that reorders them is refused
    by the generator, not encoded in the wrong order."""

    class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
        block_hashes: list[E.BlockHash]
        group_idx: int | None = None
        medium: str | None = None

    monkeypatch.setattr(E, "BlockRemoved", BlockRemoved)
    with pytest.raises(AssertionError, match="declaration order"):
        event_tables.render()
