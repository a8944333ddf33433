"""Decode every message captured from real SGLang / vLLM publishers and check that applying them to
a plain per-worker {medium: set(hash)} reference reproduces the recorded final states."""
from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from schemas.codec import decode_batch
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from schemas.media import parse_medium

U64 = (1 << 64) - 1
SAMPLES = ["sglang", "vllm", "vllm_bytes"]

State = dict[object, dict[str, set]]


def load_messages(d: Path, name: str) -> list[tuple[int, bytes, int, bytes]]:
    msgs = msgspec.msgpack.decode((d / f"{name}.msgpack").read_bytes())
    assert isinstance(msgs, list) and msgs, "empty capture"
    return [tuple(m) for m in msgs]  # type: ignore[misc]


def apply(state: State, worker: object, batch: KVEventBatch) -> None:
    media = state.setdefault(worker, {})
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            media.setdefault(ev.medium, set()).update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            media.setdefault(ev.medium, set()).difference_update(ev.block_hashes)
        else:
            assert isinstance(ev, AllBlocksCleared)
            for s in media.values():
                s.clear()


def expected_state(d: Path, name: str, canonical: bool) -> tuple[State, dict[object, int]]:
    exp = json.loads((d / f"{name}.expected.json").read_text())
    state: State = {}
    counts: dict[object, int] = {}
    for w in exp["workers"]:
        counts[w["worker"]] = w["batches"]
        media: dict[str, set] = {}
        for medium, hashes in w["final"].items():
            key = parse_medium(medium).name if canonical else medium
            vals = {bytes.fromhex(h) if isinstance(h, str) else (h & U64 if canonical else h) for h in hashes}
            media.setdefault(key, set()).update(vals)
        state[w["worker"]] = media
    return state, counts


def nonempty(state: State) -> State:
    return {w: {m: s for m, s in media.items() if s} for w, media in state.items()}


@pytest.mark.parametrize("name", SAMPLES)
def test_every_captured_message_decodes(wire_samples_dir: Path, name: str) -> None:
    msgs = load_messages(wire_samples_dir, name)
    seqs: dict[int, list[int]] = {}
    n_events = 0
    for worker, topic, seq, payload in msgs:
        assert isinstance(topic, bytes) and isinstance(payload, bytes)
        batch = decode_batch(payload)
        assert isinstance(batch, KVEventBatch), f"{name} seq {seq}: {batch}"
        n_events += len(batch.events)
        seqs.setdefault(worker, []).append(seq)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                assert ev.medium in ("GPU", "CPU_PINNED")
                assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
                assert all((isinstance(h, int) and 0 <= h <= U64) or isinstance(h, bytes)
                           for h in ev.block_hashes)
    assert n_events > 0
    _, counts = expected_state(wire_samples_dir, name, canonical=True)
    for worker, ss in seqs.items():
        assert ss == list(range(len(ss))), "per-publisher seq runs 0, 1, 2, ..."
        assert len(ss) == counts[worker]


@pytest.mark.parametrize("name", SAMPLES)
def test_replaying_capture_reproduces_expected_state(wire_samples_dir: Path, name: str) -> None:
    msgs = load_messages(wire_samples_dir, name)
    # Normalised decode vs expected after alias normalisation and u64 normalisation.
    state: State = {}
    for worker, _topic, _seq, payload in msgs:
        batch = decode_batch(payload)
        assert isinstance(batch, KVEventBatch)
        apply(state, worker, batch)
    want, _ = expected_state(wire_samples_dir, name, canonical=True)
    assert nonempty(state) == nonempty(want)
    assert any(len(media.get("CPU_PINNED", ())) for media in state.values()), "host tier exercised"

    # Un-normalised decode must match the engine's own strings and hash values exactly.
    raw_state: State = {}
    for worker, _topic, _seq, payload in msgs:
        batch = decode_batch(payload, normalize=False)
        assert isinstance(batch, KVEventBatch)
        for ev in batch.events:
            if not isinstance(ev, AllBlocksCleared) and ev.medium is None:
                ev.medium = "GPU"
        apply(raw_state, worker, batch)
    raw_want, _ = expected_state(wire_samples_dir, name, canonical=False)
    assert nonempty(raw_state) == nonempty(raw_want)
