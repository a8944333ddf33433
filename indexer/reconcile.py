"""The reconciliation policy: what a worker's stream events mean for its entries in the index
(docs/service.md, "Reconciliation policy"). One pure module, driven by live ingestion
(router_api/ingest.py), by `kvatlas replay --apply` (indexer/replay.py) and by any later transport.

Pure: no I/O, no index, no threads, no clock (`now` is passed in). Inputs are what a transport
delivers — an applied batch's outcome, a gap (recovered by replay or not), a publisher restart, the
passing of time — and each returns a `Decision` the shell carries out: clear the worker in the
index, count a resync (and ask the publisher for a snapshot), count a drop. Liveness (connecting /
live / resyncing / stale / expired) is judged here too, from the same per-worker `StreamState`.

Rules (one place each):
- gap recovered by replay       -> apply what follows, count a replay;
- gap replay could not cover    -> clear the worker, resync (snapshot request), then apply what
                                   follows; the stream is no longer clean;
- publisher restart             -> clear the worker, then apply; the stream is clean again;
- batch with AllBlocksCleared   -> the stream is clean again (a reset, or a snapshot answer);
- batch whose orphans expired   -> on a clean stream: clear + resync (first sign of loss); after
                                   an earlier clear: only the expected echo, counted as a drop;
- batch whose payload does not decode (a `decode_*` drop) -> a whole-batch drop, nothing applied;
- silence                       -> stale past the deadline (looser for engines that never
                                   heartbeat), expired past `remove_after_s` (heartbeating only).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from indexer.core import native as native_core

# The statuses in the order `status_columns` in C indexes them (stale, resyncing, connecting, live).
_STATUS_NAMES = ("stale", "resyncing", "connecting", "live")
_native_columns = getattr(native_core.select(None) if native_core.available() else None, "status_columns", None)


class LivenessPolicy:
    __slots__ = ("stale_after_s", "remove_after_s", "silent_engine_factor", "resync_hold_s")

    def __init__(
        self,
        stale_after_s: float = 10.0,
        remove_after_s: float = 300.0,
        silent_engine_factor: float = 6.0,
        resync_hold_s: float = 30.0,
    ) -> None:
        if stale_after_s <= 0 or remove_after_s < stale_after_s:
            raise ValueError("need 0 < stale_after_s <= remove_after_s")
        if silent_engine_factor < 1 or resync_hold_s < 0:
            raise ValueError("need silent_engine_factor >= 1 and resync_hold_s >= 0")
        self.stale_after_s = stale_after_s
        self.remove_after_s = remove_after_s
        self.silent_engine_factor = silent_engine_factor
        self.resync_hold_s = resync_hold_s


class Decision:
    """What the shell does after one input. Shared immutable instances (see the constants below):
    the common case (an in-order batch) allocates nothing.

    clear: remove the worker's entries from the index before applying anything that follows;
    resync: the reason label of a resync (count it; ask the publisher for a snapshot), else None;
    drop: a drop reason to count, else None; replayed: a gap the replay filled (count it);
    restart: a publisher restart (count it)."""

    __slots__ = ("clear", "resync", "drop", "replayed", "restart")

    def __init__(self, *, clear: bool = False, resync: str | None = None, drop: str | None = None,
                 replayed: bool = False, restart: bool = False) -> None:
        self.clear = clear
        self.resync = resync
        self.drop = drop
        self.replayed = replayed
        self.restart = restart

    def __repr__(self) -> str:
        fields = [f"{k}={getattr(self, k)!r}" for k in self.__slots__ if getattr(self, k)]
        return "Decision(" + ", ".join(fields) + ")"


NOTHING = Decision()
GAP_REPLAYED = Decision(replayed=True)
GAP_LOST = Decision(clear=True, resync="replay_cannot_cover")
RESTARTED = Decision(clear=True, restart=True)
ORPHANS_LOST = Decision(clear=True, resync="orphans_expired")
ORPHANS_ECHO = Decision(drop="orphans_after_resync")


class StreamState:
    """What the policy knows of one worker's stream. The live registry's RegisteredWorker extends it;
    the offline replay keeps one per recorded worker."""

    __slots__ = (
        "worker_id", "registered_at", "last_msg_at", "last_seq", "heartbeats", "batches", "gaps",
        "missing", "replays", "resyncs", "restarts", "resync_until", "reported_status", "clean",
    )

    def __init__(self, worker_id: str, now: float, last_seq: int | None = None) -> None:
        self.worker_id = worker_id
        self.registered_at = now
        self.last_msg_at: float | None = None
        self.last_seq = last_seq
        self.heartbeats = 0
        self.batches = 0
        self.gaps = 0
        self.missing = 0  # seqs lost in gaps replay could not cover
        self.replays = 0
        self.resyncs = 0
        self.restarts = 0
        self.resync_until: float | None = None
        self.reported_status = "connecting"
        # False once a loss forced a clear: from then on, stores naming parents from before the
        # clear (orphans) are the expected echo of that loss, not a new one. A reset makes it True.
        self.clean = True

    # -- liveness ------------------------------------------------------------------------------
    def silent_for(self, now: float) -> float:
        return now - (self.last_msg_at if self.last_msg_at is not None else self.registered_at)

    def stale_deadline(self, policy: LivenessPolicy) -> float:
        if self.heartbeats:
            return policy.stale_after_s
        return policy.stale_after_s * policy.silent_engine_factor

    def status(self, now: float, policy: LivenessPolicy) -> str:
        if self.silent_for(now) > self.stale_deadline(policy):
            return "stale"
        if self.resync_until is not None and now < self.resync_until:
            return "resyncing"
        if self.last_msg_at is None:
            return "connecting"
        return "live"

    def expired(self, now: float, policy: LivenessPolicy) -> bool:
        # Only workers that proved they heartbeat can be judged dead by silence.
        return self.heartbeats > 0 and self.silent_for(now) > policy.remove_after_s


def statuses(states: Sequence[StreamState], now: float, policy: LivenessPolicy) -> list[str]:
    """`[s.status(now, policy) for s in states]` (the first column of `status_columns`)."""
    return status_columns(states, now, policy)[0]


def status_columns(states: Sequence[StreamState], now: float,
                   policy: LivenessPolicy) -> tuple[list[str], list[int | None]]:
    """`[s.status(now, policy) for s in states]` and `[s.last_seq for s in states]`: every /score
    answer carries each worker's status and last sequence number. `StreamState.status` is the rule;
    with the C module the columns are read from the states' slots in C (`status_columns` in
    indexer/_native/answer.c, its accelerator: ~3 us less at 32 workers), held equal to the rule by
    tests/test_reconcile.py. What C declines (a state not in plain slots, a time not a float) the rule
    answers here."""
    if _native_columns is not None and type(states) is list and type(now) is float:
        hb = _exact_float(policy.stale_after_s)
        silent = _exact_float(policy.stale_after_s * policy.silent_engine_factor)
        if hb is not None and silent is not None:
            got = _native_columns(states, now, hb, silent, _STATUS_NAMES)
            if got is not None:
                return got
    return [s.status(now, policy) for s in states], [s.last_seq for s in states]


def _exact_float(x: object) -> float | None:
    """`x` as the float that compares as `x` does (a float, or an int a double holds exactly), else None."""
    if type(x) is float:
        return x
    if type(x) is int and -(1 << 53) <= x <= 1 << 53:
        return float(x)
    return None


# --- inputs ------------------------------------------------------------------------------------

def on_batch(s: StreamState, seq: int, now: float, policy: LivenessPolicy, heartbeat: bool = False,
             cleared: bool = False, orphans: bool = False) -> Decision:
    """A batch was applied (or was a heartbeat). `cleared`: it held an AllBlocksCleared;
    `orphans`: the apply reported expired orphans (a parent never arrived)."""
    if cleared:  # a reset or a snapshot answer: what follows in the batch rebuilds the view exactly
        s.clean = True
        s.resync_until = None
    s.last_seq = seq
    s.last_msg_at = now
    s.batches += 1
    if heartbeat:
        s.heartbeats += 1
    if not orphans:
        return NOTHING
    s.resync_until = now + policy.resync_hold_s
    if not s.clean:  # clearing again would throw away what was rebuilt since the first clear
        return ORPHANS_ECHO
    s.clean = False
    s.resyncs += 1
    return ORPHANS_LOST


def on_run(s: StreamState, last_seq: int, n: int, now: float, cleared: bool) -> Decision:
    """`n` consecutive batches up to `last_seq` were applied, none a heartbeat, none with expired
    orphans (`cleared`: one of them held an AllBlocksCleared): the same state as `n` calls of
    `on_batch`, in one step (the live ingest applies in-order runs at once)."""
    if cleared:
        s.clean = True
        s.resync_until = None
    s.last_seq = last_seq
    s.last_msg_at = now
    s.batches += n
    return NOTHING


def on_gap(s: StreamState, first: int, last: int, now: float, policy: LivenessPolicy, *,
           recovered: bool) -> Decision:
    """Seqs first..last were missing; `recovered`: a replay filled all of them (delivered next)."""
    s.gaps += 1
    s.last_msg_at = now
    if recovered:
        s.replays += 1
        return GAP_REPLAYED
    s.missing += last - first + 1
    s.resyncs += 1
    s.resync_until = now + policy.resync_hold_s
    s.clean = False
    return GAP_LOST


def on_restart(s: StreamState, now: float) -> Decision:
    """The publisher started over (its seq went back)."""
    s.restarts += 1
    s.last_msg_at = now
    s.last_seq = None
    s.clean = True
    s.resync_until = None
    return RESTARTED


def on_tick(states: Iterable[StreamState], now: float, policy: LivenessPolicy
            ) -> tuple[list[tuple[str, str, str]], list[str]]:
    """Time passed: status transitions since the last tick `(worker, old, new)` (e.g. to `stale`)
    and the workers past removal, which the shell unregisters."""
    changes: list[tuple[str, str, str]] = []
    expired: list[str] = []
    for s in states:
        st = s.status(now, policy)
        if st != s.reported_status:
            changes.append((s.worker_id, s.reported_status, st))
            s.reported_status = st
        if s.expired(now, policy):
            expired.append(s.worker_id)
    return changes, expired


# --- reading an apply's outcome ------------------------------------------------------------------

def whole_batch_drop(drops: Mapping[str, int]) -> str | None:
    """The `decode_*` reason when the payload did not decode (nothing of it applies), else None."""
    for reason, n in drops.items():
        if n and reason.startswith("decode_"):
            return reason
    return None


def cleared_in(counts: Mapping[tuple[str, str, str], int]) -> bool:
    """Whether an apply's block counts include an AllBlocksCleared."""
    for key, n in counts.items():
        if n and key[0] == "cleared":
            return True
    return False


def batch_rank(batch_rank: Any, frame_rank: Any, default: int) -> int:
    """The dp_rank a batch applies to: its own when a non-negative int, else the transport's
    (e.g. a log frame's), else the worker's registered rank."""
    for r in (batch_rank, frame_rank):
        if isinstance(r, int) and not isinstance(r, bool) and r >= 0:
            return r
    return default
