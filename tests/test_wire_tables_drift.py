"""The C accelerator's wire tables come from schemas/ (docs/index-core.md): the committed header is what
the generator writes today, and the built module reports the same tables."""
from __future__ import annotations

from indexer._native import _kvnative, wire
from indexer.core import native as native_core
from schemas.events import BlockStored, is_full_attention
from schemas.media import MEDIUM_ALIASES, Medium


def test_committed_header_is_generated_from_schemas() -> None:
    assert wire.HEADER.read_text() == wire.render(), "run: python -m indexer._native.wire --write"


def test_built_module_reports_the_schema_tables() -> None:
    assert _kvnative.wire_tables() == wire.tables()
    assert native_core.unavailable_reason() is None


def test_tables_follow_the_schema_sources() -> None:
    t = wire.tables()
    assert t["stored_fields"] == BlockStored.__struct_fields__
    assert dict(t["media"]) == {k: int(v) for k, v in MEDIUM_ALIASES.items()}
    assert t["medium_names"] == tuple(m.name for m in Medium)
    assert [is_full_attention(k) for k in ("full_attention", "MLA", "sliding_window", "mamba", None)] == [
        True, True, False, False, True]


def test_drift_is_detected(monkeypatch) -> None:
    """A schema change the header does not have makes the drift checks fail (here: a new alias)."""
    monkeypatch.setitem(MEDIUM_ALIASES, "HBM", Medium.GPU)
    assert wire.HEADER.read_text() != wire.render()
    assert _kvnative.wire_tables() != wire.tables()
