"""Turning per-request records into the demo table's rows (pure; docs/end-to-end.md, "Reading the table").

A prediction is the number of prompt tokens the policy expects the worker to serve from cache; it is
right when it equals what the worker did serve (`served`, any tier). Each wrong one is put down to a
measured cause (`mismatch_cause`), from what the worker held when the request arrived and how much of
the prediction came from in-flight (pending) routes.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from sim.api import PolicyRow, RequestRecord

# cause -> the table's wording
CAUSES = {
    "unseen": "worker held more than predicted (stores the prediction missed: events not yet visible and "
              "no route reported, or another router's decisions)",
    "unlanded": "pending route's blocks not yet stored when it arrived (requests reordered)",
    "evicted": "held less on arrival than predicted (evicted, or a guess that never was)",
    "lost": "held on arrival, served less (evicted or prefetch unfinished before it ran)",
    "extra": "served more than held on arrival",
}


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile: the smallest value with at least q of the values at or below it."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(1, math.ceil(q * len(s) - 1e-9))
    return s[k - 1]


def mismatch_cause(r: RequestRecord) -> str | None:
    """Why a prediction missed what the worker served (None: it did not miss, or made none)."""
    if r.predicted_cached is None or r.served is None:
        return None
    pred, served = r.predicted_cached, r.served.cached
    if served == pred:
        return None
    held = r.arrival_cached if r.arrival_cached is not None else served
    if served > pred:
        return "unseen" if held > pred else "extra"
    if held >= pred:
        return "lost"
    pend = r.predicted_pending or 0
    return "unlanded" if pend and held >= pred - pend else "evicted"


def summarize(policy: str, routers: int, records: Iterable[RequestRecord]) -> PolicyRow:
    recs = list(records)
    ok = [r for r in recs if r.error is None and r.served is not None and r.ttft_s is not None]
    total = sum(r.input_tokens for r in ok)
    cached = sum(r.served.cached for r in ok)  # type: ignore[union-attr]
    ttft = [r.ttft_s for r in ok]  # type: ignore[misc]
    predicted = [r for r in ok if r.predicted_cached is not None]
    behind = sum(1 for r in predicted if r.served.cached > r.predicted_cached)  # type: ignore[union-attr,operator]
    ahead = sum(1 for r in predicted if r.served.cached < r.predicted_cached)  # type: ignore[union-attr,operator]
    accuracy = (len(predicted) - behind - ahead) / len(predicted) if predicted else None
    held = [r for r in predicted if r.arrival_cached is not None]
    held_ok = sum(1 for r in held if r.arrival_cached == r.predicted_cached)
    causes: dict[str, int] = {}
    for r in predicted:
        c = mismatch_cause(r)
        if c is not None:
            causes[c] = causes.get(c, 0) + 1
    waits = sorted(r.wait_s for r in recs if r.wait_s is not None)
    return PolicyRow(
        policy=policy, routers=routers, requests=len(ok),
        hit_ratio=round(cached / total, 4) if total else 0.0,
        prefill_tokens=sum(r.served.computed for r in ok),  # type: ignore[union-attr]
        ttft_mean_s=round(sum(ttft) / len(ttft), 4) if ttft else 0.0,
        ttft_p90_s=round(quantile(ttft, 0.9), 4),
        prediction_accuracy=None if accuracy is None else round(accuracy, 4),
        errors=len(recs) - len(ok), index_behind=behind, index_ahead=ahead, causes=causes,
        held_accuracy=round(held_ok / len(held), 4) if held else None,
        waits=len(waits), wait_timeouts=sum(1 for r in recs if r.wait_timeout),
        wait_p50_ms=round(1e3 * quantile(waits, 0.5), 2) if waits else None,
        wait_max_ms=round(1e3 * waits[-1], 2) if waits else None)


def format_waits(rows: Sequence[PolicyRow]) -> str:
    """One line per run whose requests waited for admission (causal forwarding); empty if none did."""
    return "\n".join(f"causal forwarding, {r.policy} x{r.routers}: {r.waits} requests waited for the admission of "
                     f"routes their prediction counted (median {r.wait_p50_ms:.1f} ms, max {r.wait_max_ms:.1f} ms "
                     f"wall clock), {r.wait_timeouts} timed out" for r in rows if r.waits)


def format_table(rows: Sequence[PolicyRow]) -> str:
    head = (f"{'policy':<16} {'routers':>7} {'requests':>8} {'hit ratio':>9} {'prefill tokens':>14} "
            f"{'TTFT mean':>9} {'TTFT p90':>9} {'prediction':>10}  why not exact")
    lines = [head, "-" * len(head)]
    for r in rows:
        acc = "-" if r.prediction_accuracy is None else f"{100 * r.prediction_accuracy:.1f}%"
        why = [f"{n} {CAUSES.get(c, c)}" for c, n in sorted(r.causes.items(), key=lambda kv: -kv[1])]
        if r.errors:
            why.append(f"{r.errors} errors")
        lines.append(f"{r.policy:<16} {r.routers:>7} {r.requests:>8} {r.hit_ratio:>9.3f} {r.prefill_tokens:>14,} "
                     f"{r.ttft_mean_s:>8.2f}s {r.ttft_p90_s:>8.2f}s {acc:>10}  {'; '.join(why)}")
    return "\n".join(lines)
