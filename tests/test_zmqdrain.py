"""The C receive loop (indexer/_native/zmqdrain.c) against pyzmq frame by frame: over real ZeroMQ
sockets, any stream of in-order, gapped, repeated, restarted and malformed messages gives the same
deliveries, stats and seq-tracker fingerprints either way, with and without `Run` deliveries."""
from __future__ import annotations

import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.sequencing import fingerprint
from indexer.deliveries import Batch, Run
from indexer.subscriber import Subscriber
from schemas.frames import seq_bytes


msg = st.one_of(
    st.tuples(st.just("ok"), st.integers(0, 40), st.binary(max_size=80)),
    st.tuples(st.just("frames"), st.sampled_from([1, 2, 4, 5]), st.binary(max_size=8)),
    st.tuples(st.just("seqlen"), st.sampled_from([0, 1, 7, 9]), st.binary(max_size=8)),
)


def frames_of(m: tuple) -> list[bytes]:
    kind, v, payload = m
    if kind == "ok":
        return [b"", seq_bytes(v), payload]
    if kind == "frames":
        return [b""] * (v - 1) + [payload]
    return [b"", b"\x00" * v, payload]


def in_order(seqs: list[int]) -> list[tuple]:
    """Mostly consecutive seqs (what a healthy publisher sends), with the odd jump."""
    return [("ok", s, bytes([s % 256]) * (s % 70)) for s in seqs]


def run_stream(msgs: list[tuple], native: bool, runs: bool) -> tuple[list, dict, tuple]:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = Subscriber(ctx, native_recv=native, runs=runs)
    try:
        sub.add("w", f"tcp://127.0.0.1:{port}")
        assert pub.poll(10_000), "no subscription arrived"
        pub.recv()  # the SUB's subscription: it is connected, nothing sent from now on is lost
        for m in msgs:
            pub.send_multipart(frames_of(m))
        got: list = []
        while sub.stats.received < len(msgs):
            got += sub.poll(200)
        flat = []
        for d in got:
            if isinstance(d, Run):
                flat += [("batch", d.first_seq + k, p, False) for k, p in enumerate(d.payloads)]
            elif isinstance(d, Batch):
                flat.append(("batch", d.seq, d.payload, d.replayed))
            else:
                flat.append((type(d).__name__,) + tuple(getattr(d, f) for f in d.__struct_fields__))
        tr = sub._sources["w"].tracker
        rings = (list(tr._fp_seq), list(tr._fp)) if tr._fp is not None else None
        stats = {f: getattr(sub.stats, f) for f in sub.stats.__struct_fields__}
        return flat, stats, (tr.last, tr.live_last, rings)
    finally:
        sub.close()
        pub.close(0)
        ctx.term()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(msg, st.integers(0, 30).map(lambda n: ("run", n, b""))), max_size=25))
def test_c_loop_and_pyzmq_deliver_the_same(spec: list) -> None:
    msgs: list[tuple] = []
    nxt = 0
    for m in spec:
        if m[0] == "run":  # a run of in-order messages continuing from the last good seq
            msgs += in_order(list(range(nxt, nxt + m[1])))
            nxt += m[1]
        else:
            msgs.append(m)
            if m[0] == "ok":
                nxt = m[1] + 1
    ref = run_stream(msgs, native=False, runs=False)
    assert run_stream(msgs, native=True, runs=False) == ref
    assert run_stream(msgs, native=True, runs=True) == ref
    assert run_stream(msgs, native=False, runs=True) == ref


def test_runs_come_whole_and_fingerprints_match_python() -> None:
    msgs = in_order(list(range(0, 300)))
    flat, stats, (last, live_last, rings) = run_stream(msgs, native=True, runs=True)
    assert [d[1] for d in flat] == list(range(300)) and last == live_last == 299
    assert stats["received"] == 300 and stats["bad_frames"] == 0
    seqs, fps = rings
    for s in range(300 - 256, 300):  # the ring keeps the newest FP_WINDOW deliveries
        assert seqs[s % 256] == s and fps[s % 256] == fingerprint(msgs[s][2])
