"""Children die with their parent (router_api/procs.py): on SIGTERM, SIGINT and the parent's own
death (SIGKILL), for a bare `spawn` and for a real `kvatlas demo` and its indexer / worker children.
Every check reads /proc: a child that survives fails the test (and is killed by it)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support.net import wait_until
from support.proctree import Proc, descendants, running
from router_api.procs import spawn

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")

# A parent that starts one long child (and the child a grandchild, as kvatlas's children start theirs:
# with `spawn`) and waits to be signalled.
_PARENT = textwrap.dedent("""
    import sys
    from router_api.procs import exit_on_signals, spawn, stop
    with exit_on_signals():
        child = spawn([sys.executable, "-c", "import sys, time; from router_api.procs import spawn; "
                       "spawn([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)"],
                      session=True)
        try:
            print(child.pid, flush=True)
            sys.stdin.read()  # until the test signals us
        finally:
            stop(child)
""")


def _reap_survivors(procs: set[Proc]) -> list[Proc]:
    """The ones still running, killed so that a failing test leaves nothing behind."""
    left = [p for p in procs if running(p)]
    for p in left:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _all_gone(procs: set[Proc], timeout: float = 20.0) -> list[Proc]:
    try:
        wait_until(lambda: not any(running(p) for p in procs), timeout=timeout, interval=0.05)
    except AssertionError:
        pass
    return _reap_survivors(procs)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_spawned_children_die_with_their_parent(sig: signal.Signals) -> None:
    parent = spawn([sys.executable, "-c", _PARENT], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        int(parent.stdout.readline())  # the child runs
        wait_until(lambda: len(descendants(parent.pid)) >= 2, timeout=20)  # and its own child
        family = descendants(parent.pid)
        parent.send_signal(sig)
        rc = parent.wait(20)
        assert rc == (128 + sig if sig == signal.SIGTERM else -sig)  # SIGINT: KeyboardInterrupt, then re-raised
        assert _all_gone(family) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_kvatlas_demo_children_die_with_it(sig: signal.Signals, tmp_path: Path) -> None:
    """A real `kvatlas demo` (process fleet, small): signalled once its indexer and a worker run,
    none of its processes outlives it."""
    with open(tmp_path / "demo.out", "wb") as out:
        demo = spawn([sys.executable, "-m", "cli.main", "demo", "--workers", "1", "--requests", "4", "--routers", "1",
                      "--policies", "round_robin"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    seen: set[Proc] = set()
    try:
        def two_children() -> bool:
            if demo.poll() is not None:
                raise AssertionError(f"demo exited early:\n{(tmp_path / 'demo.out').read_text()[-2000:]}")
            seen.update(descendants(demo.pid))
            return len([p for p in seen if running(p)]) >= 2  # the indexer and the first worker
        wait_until(two_children, timeout=120, interval=0.1)
        seen.update(descendants(demo.pid))
        demo.send_signal(sig)
        rc = demo.wait(60)
        assert rc == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + sig)
        assert _all_gone(seen, timeout=30) == []
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(10)
        _reap_survivors(seen | descendants(demo.pid))
