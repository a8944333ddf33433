"""GET /health every INTERVAL_MS from a process of its own until its stdin closes, then print
{"ms": [latencies], "errors": [...]} as JSON: the probe bench/bench_health_under_load.py and the
hostile soaks (tests/support/hostile.py HealthProbe) measure /health with, so neither the caller's
threads nor its GIL add to the latencies.

    python -m bench.support.health_probe URL [INTERVAL_MS]
"""
import json
import sys
import threading
import time

import httpx


def main() -> None:
    url, interval = sys.argv[1], (float(sys.argv[2]) if len(sys.argv) > 2 else 20.0) / 1e3
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    ms: list[float] = []
    errors: list[str] = []
    with httpx.Client(base_url=url, timeout=60.0) as c:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                code = c.get("/health").status_code
            except httpx.HTTPError as exc:
                errors.append(repr(exc))
            else:
                ms.append((time.perf_counter() - t) * 1e3)
                if code != 200:
                    errors.append(f"status {code}")
            stop.wait(interval)
    print(json.dumps({"ms": ms, "errors": errors}))


if __name__ == "__main__":
    main()
