"""`kvctl serve` stopped and started again (restoring its snapshot) while Dynamo 1.6.1 mockers keep storing and
evicting: it must come back to the index Dynamo's indexer holds, its streams resumed after the seqs its state dir
kept and the batches it missed asked of the mockers' replay buffers, which hold every one of them.

A fleet of its own (the test restarts its kvctl router): two mockers on Dynamo's default ZMQ event plane, Dynamo's
frontend, Dynamo's indexer and kvctl on the mockers' ZMQ streams and replays.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.commands.live_router import kvctl
from tests.interop.fleet import KV_BLOCKS, Fleet, indexer_blocks, kvctl_blocks, settled, shared_prefix_load, start_fleet


@pytest.fixture
def own_fleet(dynamo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    started = start_fleet(tmp_path_factory.mktemp("interop-restart"), dynamo, mockers=2)
    yield started
    started.stop()


def _same_as_indexer(fleet: Fleet) -> tuple[int, str]:
    settled(lambda: indexer_blocks(fleet), "the indexer's dump", procs=fleet.procs)
    settled(lambda: kvctl_blocks(fleet.kvctl_url), "kvctl's index", procs=fleet.procs)  # type: ignore[arg-type]
    diff = kvctl(fleet.kvctl_url, "tree", "diff", "--exit-code", fleet.kvctl_url,  # type: ignore[arg-type]
                 f"dynamo+{fleet.indexer_url}")
    return diff.exit_code, diff.output


def test_a_restarted_kvctl_catches_up_with_the_engines(own_fleet: Fleet) -> None:
    assert not shared_prefix_load(own_fleet.frontend_url, seed=1).failed
    code, output = _same_as_indexer(own_fleet)
    assert code == 0, f"kvctl differed from the indexer before any restart:\n{output}"

    stopped = own_fleet.routers["kvctl"].proc
    assert stopped.stop() == 0  # SIGTERM, by its pid: it writes its snapshot and exits cleanly
    assert not shared_prefix_load(own_fleet.frontend_url, seed=2).failed  # stores and evictions it does not see
    own_fleet.restart_router("kvctl")
    own_fleet.await_kvctl()
    assert not shared_prefix_load(own_fleet.frontend_url, seed=3).failed

    code, output = _same_as_indexer(own_fleet)
    held = kvctl_blocks(own_fleet.kvctl_url)  # type: ignore[arg-type]
    streams = httpx.get(f"{own_fleet.kvctl_url}/v1/status", timeout=10).json()["streams"]
    assert all(blocks <= KV_BLOCKS for blocks in held.values()), \
        f"kvctl holds more blocks than the mockers' caches: {held}\n{streams}"
    assert code == 0, f"kvctl differs from the indexer after its restart:\n{output}\n{streams}"
