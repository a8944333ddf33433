"""The OpenAI proxy's own metrics (docs/openai.md, "Metrics"): outcomes, decision and indexer
latency, and live prediction accuracy — the predicted cached tokens against what the engine says
it served (`usage.prompt_tokens_details.cached_tokens`, vLLM with --enable-prompt-tokens-details,
SGLang's `cached_tokens`, `kvatlas worker`)."""
from __future__ import annotations

import bisect
import re

_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# the last `"cached_tokens": N` of an answer (JSON body or the SSE usage chunk), read from its tail
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
TAIL_BYTES = 4096


class Histogram:
    __slots__ = ("counts", "total", "n")

    def __init__(self) -> None:
        self.counts = [0] * (len(_BOUNDS) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(_BOUNDS, seconds)] += 1
        self.total += seconds
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        acc = 0
        for b, c in zip(_BOUNDS, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out.append(f"{name}_sum {self.total:.6f}")
        out.append(f"{name}_count {self.n}")
        return out


def served_cached(tail: bytes) -> int | None:
    """The engine's cached prompt tokens from the last bytes of its answer; None if it says none."""
    found = None
    for m in _CACHED.finditer(tail):
        found = m
    return None if found is None else int(found.group(1))


class Accuracy:
    """Predicted vs served cached tokens, per request the engine reported it for."""

    __slots__ = ("compared", "exact", "over", "under", "abs_error_tokens")

    def __init__(self) -> None:
        self.compared = 0
        self.exact = 0
        self.over = 0    # predicted more than the engine served (the index was ahead)
        self.under = 0   # predicted less (behind)
        self.abs_error_tokens = 0

    def observe(self, predicted: int, served: int) -> None:
        self.compared += 1
        if predicted == served:
            self.exact += 1
        elif predicted > served:
            self.over += 1
        else:
            self.under += 1
        self.abs_error_tokens += abs(predicted - served)

    def ratio(self) -> float | None:
        return self.exact / self.compared if self.compared else None

    def lines(self) -> list[str]:
        return ["# TYPE kvatlas_router_predictions_total counter",
                *(f'kvatlas_router_predictions_total{{result="{k}"}} {getattr(self, k)}'
                  for k in ("exact", "over", "under")),
                "# TYPE kvatlas_router_prediction_error_tokens_total counter",
                f"kvatlas_router_prediction_error_tokens_total {self.abs_error_tokens}"]
