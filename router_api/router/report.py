"""Turning per-request records into the demo table's rows (pure; docs/end-to-end.md, "Reading the table")."""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from producer.sim.api import PolicyRow, RequestRecord


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile: the smallest value with at least q of the values at or below it."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(1, math.ceil(q * len(s) - 1e-9))
    return s[k - 1]


def summarize(policy: str, routers: int, records: Iterable[RequestRecord]) -> PolicyRow:
    recs = list(records)
    ok = [r for r in recs if r.error is None and r.served is not None and r.ttft_s is not None]
    total = sum(r.input_tokens for r in ok)
    cached = sum(r.served.cached for r in ok)  # type: ignore[union-attr]
    ttft = [r.ttft_s for r in ok]  # type: ignore[misc]
    predicted = [r for r in ok if r.predicted_cached is not None and r.arrival_cached is not None]
    behind = sum(1 for r in predicted if r.arrival_cached > r.predicted_cached)  # type: ignore[operator]
    ahead = sum(1 for r in predicted if r.arrival_cached < r.predicted_cached)  # type: ignore[operator]
    accuracy = (len(predicted) - behind - ahead) / len(predicted) if predicted else None
    return PolicyRow(
        policy=policy, routers=routers, requests=len(ok),
        hit_ratio=round(cached / total, 4) if total else 0.0,
        prefill_tokens=sum(r.served.computed for r in ok),  # type: ignore[union-attr]
        ttft_mean_s=round(sum(ttft) / len(ttft), 4) if ttft else 0.0,
        ttft_p90_s=round(quantile(ttft, 0.9), 4),
        prediction_accuracy=None if accuracy is None else round(accuracy, 4),
        errors=len(recs) - len(ok), index_behind=behind, index_ahead=ahead)


def format_table(rows: Sequence[PolicyRow]) -> str:
    head = (f"{'policy':<16} {'routers':>7} {'requests':>8} {'hit ratio':>9} {'prefill tokens':>14} "
            f"{'TTFT mean':>9} {'TTFT p90':>9} {'prediction':>10}  why not exact")
    lines = [head, "-" * len(head)]
    for r in rows:
        acc = "-" if r.prediction_accuracy is None else f"{100 * r.prediction_accuracy:.1f}%"
        why = []
        if r.index_behind:
            why.append(f"{r.index_behind} held more (events in flight at score time)")
        if r.index_ahead:
            why.append(f"{r.index_ahead} held less (evicted/not yet landed)")
        if r.errors:
            why.append(f"{r.errors} errors")
        lines.append(f"{r.policy:<16} {r.routers:>7} {r.requests:>8} {r.hit_ratio:>9.3f} {r.prefill_tokens:>14,} "
                     f"{r.ttft_mean_s:>8.2f}s {r.ttft_p90_s:>8.2f}s {acc:>10}  {'; '.join(why)}")
    return "\n".join(lines)
