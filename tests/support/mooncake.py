"""A real `mooncake_master` per test (producer/storage/mooncake_master.py: free ports, killed
with the test and by the kernel if the test process dies first).

The binary comes with the `mooncake` extra (mooncake-transfer-engine-non-cuda); it needs
libibverbs1, librdmacm1 and libnuma1 (scripts/ensure-system-deps.sh installs them).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from producer.storage.mooncake_master import (
    MooncakeMaster, master_binary, restart_mooncake_master, start_mooncake_master,
)

os.environ.setdefault("GLOG_minloglevel", "2")  # the Mooncake client logs every setup step at INFO

__all__ = ["MooncakeMaster", "mooncake_master", "restart", "start_mooncake_master"]


def restart(master: MooncakeMaster, tmp_dir: Path) -> MooncakeMaster:
    return restart_mooncake_master(master)


@pytest.fixture
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """A fresh master for this test, leases short (100 ms) so removals after a read go through."""
    if master_binary() is None:
        pytest.fail("mooncake_master not found (make test installs the `mooncake` extra and its system libraries)")
    master = start_mooncake_master(tmp_path_factory.mktemp("mooncake"), "--default_kv_lease_ttl=100")
    try:
        yield master
    finally:
        master.stop()


def drop_behind_back(master: MooncakeMaster, keys: list[str], prefix: str = "kvatlas:") -> None:
    """Remove keys from the store as the master's own eviction would: through another client, forced
    past any lease, telling nobody. Fails unless each key is gone afterwards."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", master.metadata, 16 << 20, 16 << 20, "tcp", "", master.address) == 0
    try:
        codes = store.batch_remove([prefix + k for k in keys], True)
        assert all(c in (0, -704) for c in codes), codes  # removed, or not there to begin with
        assert store.batch_is_exist([prefix + k for k in keys]) == [0] * len(keys)
    finally:
        store.close()
