"""`kvatlas demo` on real processes: one indexer, then per run (policy × router replicas) a fresh
fleet of workers and K OpenAI routers (`kvatlas router --api openai`, what users deploy), each fed
its share of the same bounded trace slice as token-id completions by a replay client; one table at
the end (docs/end-to-end.md). The next run's workers start while the current run replays — the workers'
times are virtual (the simulated model's), so sharing the CPU does not change the numbers."""
from __future__ import annotations

import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import msgspec

from router.demo.procs import Child, free_port, http_json, kvatlas_cmd, wait_healthy
from router.progress import Progress
from router.report import format_table, format_waits, summarize
from router.trace import DEFAULT_TRACE
from router.records import PolicyRow, RouterReport

MODEL_BLOCK = 512
_PROGRESS = re.compile(r" (\d+)/\d+ \(\d+%\)")


class DemoSettings(msgspec.Struct, kw_only=True, frozen=True):
    trace: str | None = None
    requests: int = 300
    speed: float = 12.0
    policies: tuple[str, ...] = ("round_robin", "random", "least_loaded", "approximate", "precise_gpu",
                                 "precise_tiered")
    routers: int = 4
    workers: int = 4
    gpu_pages: int = 320
    host_pages: int = 960
    seed: int = 0
    admission_timeout: float = 2.0  # routers' causal forwarding wait bound (0: off; kvatlas router --admission-timeout)
    family: str = "full"      # the workers' model family (kvatlas worker --family)
    l3: str = "file"          # the workers' L3: a directory each (DISK) or one shared Mooncake Store (EXTERNAL)
    # decisions in trace order on the simulated clock, so every row repeats exactly (docs/end-to-end.md,
    # "Lockstep"); False: the replay paced on the wall clock, requests concurrent (rows vary run to run)
    lockstep: bool = True


# A hybrid fleet's default runs: the usable-prefix router beside the group-blind one (kv_blocks).
HYBRID_POLICIES = ("round_robin", "least_loaded", "approximate", "precise_kv_only", "precise_tiered")


class Run:
    """One policy with K routers on its own fresh workers (own model namespace at the indexer)."""

    def __init__(self, n: int, policy: str, routers: int, s: DemoSettings, indexer: str, tmp: Path,
                 mooncake: dict[str, object] | None = None) -> None:
        self.n = n
        self.policy = policy
        self.routers = routers
        self.s = s
        self.indexer = indexer
        self.model = f"run{n}"
        self.dir = tmp / f"run{n}"
        self.dir.mkdir()
        self.workers: list[tuple[Child, str, str]] = []  # child, worker id, url
        self.router_children: list[tuple[Child, str, Path]] = []  # the trace replay clients
        self.proxies: list[Child] = []  # the OpenAI routers they send through
        # the run's workers share one store; its own key prefix keeps runs apart
        self.l3 = (("--l3", "file", "--l3-dir") if mooncake is None else
                   ("--l3", "mooncake", "--l3-config", msgspec.json.encode({**mooncake, "prefix": f"{self.model}:"}).decode()))

    def start_workers(self) -> None:
        for j in range(self.s.workers):
            self.workers.append(self._spawn_worker(j))

    def _spawn_worker(self, j: int) -> tuple[Child, str, str]:
        wid, port = f"r{self.n}-w{j}", free_port()
        argv = kvatlas_cmd("worker", "--id", wid, "--port", str(port), "--indexer", self.indexer,
                           "--model", self.model, "--block-size", str(MODEL_BLOCK),
                           "--gpu-pages", str(self.s.gpu_pages), "--host-pages", str(self.s.host_pages),
                           *self.l3, *((str(self.dir / f"l3-{j}"),) if self.s.l3 == "file" else ()),
                           "--speed", str(self.s.speed),
                           "--family", self.s.family)
        return Child(wid, argv, self.dir), wid, f"http://127.0.0.1:{port}"

    def wait_workers(self, attempts: int = 3) -> None:
        for attempt in range(attempts):
            try:
                wait_healthy([(c, u) for c, _, u in self.workers])
                return
            except RuntimeError as exc:
                # a free port picked for us can be taken by someone else before we bind it
                if "address already in use" not in str(exc) or attempt == attempts - 1:
                    raise
                for j, (c, wid, _) in enumerate(self.workers):
                    if not c.alive():
                        c.stop()
                        try:  # it registered before failing to bind its HTTP port
                            http_json(f"{self.indexer}/workers/{wid}", method="DELETE")
                        except (OSError, ValueError):
                            pass
                        self.workers[j] = self._spawn_worker(j)

    def start_routers(self) -> None:
        """K OpenAI routers (what users deploy), each fed its share of the trace by a replay client
        (`kvatlas router --trace --via`): token-id completions through the router to the workers."""
        urls = []
        for i in range(self.routers):
            port = free_port()
            argv = kvatlas_cmd("router", "--api", "openai", "--indexer", self.indexer, "--model", self.model,
                               "--policy", self.policy, "--port", str(port), "--seed", str(self.s.seed + i),
                               "--admission-timeout", str(self.s.admission_timeout), "--metrics-interval", "0.1",
                               "--workers-interval", "0", "--block-size", str(MODEL_BLOCK),
                               "--first-byte-timeout", "600", *(("--lockstep",) if self.s.lockstep else ()),
                               *[a for c, wid, u in self.workers for a in ("--worker", f"{wid}={u}")])
            child = Child(f"openai-router-{i}", argv, self.dir)
            self.proxies.append(child)
            urls.append(f"http://127.0.0.1:{port}")
        wait_healthy(list(zip(self.proxies, urls)))
        if self.s.lockstep:  # one replay client: request i through router i mod K, one at a time
            report = self.dir / "router-0.json"
            argv = kvatlas_cmd("router", "--api", "sim", "--via", ",".join(urls), "--lockstep", "--model", self.model,
                               "--policy", self.policy, "--port", "0", "--requests", str(self.s.requests),
                               "--speed", str(self.s.speed), "--report", str(report), "--exit-after-replay",
                               "--seed", str(self.s.seed), "--trace", self.s.trace or str(DEFAULT_TRACE))
            self.router_children.append((Child("replay", argv, self.dir), "", report))
            return
        start_at = time.time() + (3.0 if self.routers > 1 else 0.0)  # replicas start the trace together
        for i, url in enumerate(urls):
            report = self.dir / f"router-{i}.json"
            argv = kvatlas_cmd("router", "--api", "sim", "--via", url, "--model", self.model, "--policy", self.policy,
                               "--port", "0", "--requests", str(self.s.requests), "--speed", str(self.s.speed),
                               "--replicas", str(self.routers), "--replica-index", str(i), "--report", str(report),
                               "--exit-after-replay", "--seed", str(self.s.seed),
                               "--start-at", f"{start_at:.3f}", "--trace", self.s.trace or str(DEFAULT_TRACE))
            self.router_children.append((Child(f"replay-{i}", argv, self.dir), "", report))

    def progress(self) -> int:
        """Requests done, from the routers' own progress lines (they print one per 10%)."""
        done = 0
        for c, _, _ in self.router_children:
            found = _PROGRESS.findall(c.tail(3))
            if found:
                done += int(found[-1])
        return done

    def wait_routers(self, bar: Progress, timeout: float = 600.0) -> PolicyRow:
        deadline = time.monotonic() + timeout
        while any(c.alive() for c, _, _ in self.router_children):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.policy}: routers still replaying after {timeout}s")
            bar.update(self.progress())
            time.sleep(0.25)  # progress refresh
        records = []
        for c, _, path in self.router_children:
            if c.proc.returncode != 0 or not path.exists():
                raise RuntimeError(f"{self.policy} {c.name} failed ({c.proc.returncode}):\n{c.tail()}")
            records.extend(msgspec.json.decode(path.read_bytes(), type=RouterReport).records)
        bar.update(len(records))
        errors = [r.error for r in records if r.error]
        if errors:  # said, not only counted: the table's errors column has no room for why
            print(f"  {self.policy} x{self.routers}: {len(errors)} errors; first: {errors[0][:300]}", file=sys.stderr)
        return summarize(self.policy, self.routers, records)

    def stop(self) -> None:
        for c, _, _ in self.router_children:
            c.stop()
        for c in self.proxies:
            c.stop()
        for c, wid, _ in self.workers:
            c.stop()
            try:  # the indexer stops subscribing to a worker that is gone
                http_json(f"{self.indexer}/workers/{wid}", method="DELETE")
            except (OSError, ValueError):
                pass


_FAMILY_NOTE = {
    "mamba": "full-attention KV + a Mamba state at every 4096-token prefill chunk's end, at the prompt's end "
             "and at a branching point, in its own LRU pool (SGLang's size: one state per 3,493 KV tokens, 3/5 of "
             "it held by a full batch of running requests)",
    "swa": "full-attention KV + 1024-token sliding-window KV of every completed prefill chunk and of the "
           "prompt's end, in its own LRU pool (SGLang's size: 0.8 x the KV pages)",
    "dsa": "MLA KV + DSA indexer keys on the same pages",
}


def _trace_name(trace: str | None) -> str:
    if trace == "builtin-chat":
        return "builtin-chat (bursty, one shared system prompt, multi-turn; seeded)"
    if trace == "builtin-conversation":
        return "builtin-conversation (long multi-turn conversations, a few system prompts; seeded)"
    return trace or "bundled Mooncake synthetic"


def visibility(indexer: str) -> str:
    """The indexer's event visibility (batch publish -> applied, i.e. visible to /score), recent batches."""
    try:
        v = http_json(f"{indexer}/stats")["pending"]["visibility"]
    except (OSError, ValueError, KeyError, TypeError):
        return "event visibility: not reported"
    if not v.get("count"):
        return "event visibility: no batches"
    return (f"event visibility (worker publish -> applied in the index, visible to /score), last {v['count']} "
            f"batches: p50 {v['p50_ms']:.1f} ms, p99 {v['p99_ms']:.1f} ms (wall clock)")


def plan(s: DemoSettings) -> list[tuple[str, int]]:
    runs = [(p, 1) for p in s.policies]
    if s.routers > 1:
        runs += [("approximate", s.routers), ("precise_tiered", s.routers)]
    return runs


def run_demo(s: DemoSettings, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> list[PolicyRow]:
    p = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    runs_plan = plan(s)
    with tempfile.TemporaryDirectory(prefix="kvatlas-demo-") as tmpd:
        tmp = Path(tmpd)
        port = free_port()
        indexer = f"http://127.0.0.1:{port}"
        idx = Child("indexer", kvatlas_cmd("indexer", "--port", str(port), "--block-size", str(MODEL_BLOCK),
                                           "--model", "demo", "--stale-after", "30"), tmp)
        runs: list[Run] = []
        rows: list[PolicyRow] = []
        vis = ""
        master = None
        try:
            wait_healthy([(idx, indexer)])
            mooncake = None
            if s.l3 == "mooncake":
                from producer.storage.mooncake_master import start_mooncake_master

                master = start_mooncake_master(tmp, "--default_kv_lease_ttl=1000")
                mooncake = master.backend_config()
            runs = [Run(i, pol, k, s, indexer, tmp, mooncake) for i, (pol, k) in enumerate(runs_plan)]
            runs[0].start_workers()
            runs[0].wait_workers()
            sim = http_json(f"{runs[0].workers[0][2]}/health")
            p(f"kvatlas demo: indexer + {s.workers} workers + router(s) as processes on loopback")
            p(f"dashboard: {indexer}/   (the index of the run in progress; each run is its own model)")
            p(f"simulated model {sim['sim']['name']}: " + ", ".join(f"{k}={v}" for k, v in sim["sim"].items()
                                                                    if k != "name"))
            if s.family != "full":
                p(f"model family {s.family}: {_FAMILY_NOTE.get(s.family, '')}")
            p(f"per worker: GPU {s.gpu_pages} + host {s.host_pages} pages of {MODEL_BLOCK} tokens, "
              f"{'L3 on a local directory (DISK)' if s.l3 == 'file' else 'L3 on one Mooncake Store (EXTERNAL)'}; "
              f"trace: {_trace_name(s.trace)}, "
              f"{s.requests} requests ({'the first by arrival' if s.trace in ('builtin-chat', 'builtin-conversation') else 'whole conversations'}), "
              f"speed x{s.speed:g}")
            p(f"runs: {', '.join(f'{pol} x{k}' for pol, k in runs_plan)}\n")
            for i, run in enumerate(runs):
                if i:
                    run.wait_workers()
                run.start_routers()
                if i + 1 < len(runs):
                    runs[i + 1].start_workers()  # overlaps this replay (virtual times are unaffected)
                bar = Progress(s.requests, f"[{i + 1}/{len(runs)}] {run.policy} x{run.routers}", err,
                               suffix=f"dashboard {indexer}/")
                rows.append(run.wait_routers(bar))
                bar.close()
                run.stop()
                r = rows[-1]
                acc = "-" if r.prediction_accuracy is None else f"{100 * r.prediction_accuracy:.1f}%"
                print(f"[{i + 1}/{len(runs)}] {run.policy} x{run.routers}: hit {r.hit_ratio:.3f}, "
                      f"prefill {r.prefill_tokens:,}, p90 TTFT {r.ttft_p90_s:.2f}s, prediction {acc}",
                      file=err, flush=True)
            vis = visibility(indexer)
        finally:
            for run in runs:
                run.stop()
            idx.stop()
            if master is not None:
                master.stop()
    p(format_table(rows))
    waits = format_waits(rows)
    if waits:
        p(f"\n{waits}")
    p(f"\n{vis}")
    p("\nhit ratio: prompt tokens served from any tier / all prompt tokens. prefill tokens: tokens computed.")
    p("TTFT: queue + load-back + prefill on the simulated model's clock. prediction: share of requests")
    p("whose predicted cached tokens equal what the worker served from cache (see docs/end-to-end.md).")
    return rows


def rows_json(rows: Sequence[PolicyRow]) -> bytes:
    keys = ("policy", "routers", "requests", "hit_ratio", "prefill_tokens", "ttft_mean_s", "ttft_p90_s",
            "prediction_accuracy", "causes", "waits", "wait_timeouts", "wait_p50_ms", "wait_max_ms")
    # causes: the "why not exact" counts, by cause; waits: causal forwarding's (docs/end-to-end.md)
    return msgspec.json.encode({"policies": [{k: getattr(r, k) for k in keys} for r in rows]})
