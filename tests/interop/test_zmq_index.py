"""`kvctl serve` following Dynamo 1.6.1 mockers' vLLM ZMQ streams (and replays) builds the same index as Dynamo's
own indexer (`python -m dynamo.indexer --threads 1`) on the same streams, through load that makes them evict."""

from __future__ import annotations

import json
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.commands.live_router import kvctl
from tests.interop.fleet import KV_BLOCKS, Fleet, indexer_blocks, kvctl_blocks, settled, shared_prefix_load


def counter(url: str, family: str, **labels: str) -> float:
    """The sum of a counter's samples in `url`'s /metrics with these labels (0 when there are none)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(sample.value for metrics in text_string_to_metric_families(text) for sample in metrics.samples
               if sample.name in (family, f"{family}_total")  # Dynamo's counters have no _total
               and all(sample.labels.get(k) == v for k, v in labels.items()))


def test_kvctl_index_equals_dynamos_indexer_under_evicting_load(fleet: Fleet) -> None:
    assert fleet.kvctl_url is not None and fleet.indexer_url is not None
    removed_before = counter(fleet.kvctl_url, "kvctl_kv_events_applied", event_type="removed", status="ok")
    dynamo_removed_before = counter(fleet.frontend_url, "dynamo_component_kv_cache_events_applied",
                                    event_type="removed", status="ok")

    load = shared_prefix_load(fleet.frontend_url, seed=1)
    assert load.failed == []
    assert load.cached_tokens > 0, "Dynamo's KV router found no cached prefix: the load shares none"

    ours = settled(lambda: kvctl_blocks(fleet.kvctl_url), "kvctl's index", procs=fleet.procs)  # type: ignore[arg-type]
    theirs = settled(lambda: indexer_blocks(fleet), "the indexer's dump", procs=fleet.procs)
    diff = kvctl(fleet.kvctl_url, "tree", "diff", "--exit-code", "-o", "json",
                 fleet.kvctl_url, f"dynamo+{fleet.indexer_url}")
    assert diff.exit_code == 0, f"{diff.output}\nkvctl: {ours}\nindexer: {theirs}\n{fleet.dump()}"
    report: dict[str, Any] = json.loads(diff.stdout)
    assert report["equal"] is True
    assert {w["worker_id"] for w in report["workers"]} == set(fleet.worker_ids)  # the ids line up: Dynamo's own
    assert all(w["blocks_a"] == w["blocks_b"] > 0 for w in report["workers"]), report["workers"]
    assert ours == theirs

    # Evictions happened, and both kvctl and Dynamo's own router applied them: no worker holds more than its cache.
    assert all(blocks <= KV_BLOCKS for blocks in ours.values()), ours
    assert counter(fleet.kvctl_url, "kvctl_kv_events_applied", event_type="removed", status="ok") > removed_before
    assert counter(fleet.frontend_url, "dynamo_component_kv_cache_events_applied",
                   event_type="removed", status="ok") > dynamo_removed_before
    status = httpx.get(f"{fleet.kvctl_url}/v1/status", timeout=10).json()
    for stream in status["streams"]:
        assert (stream["lost_batches"], stream["restarts"], stream["decode_errors"]) == (0, 0, {}), stream
        # every batch since the mocker's first (seq 0), live or replayed: kvctl joined before anything was published
        assert stream["batches_applied"] == stream["last_seq"] + 1, stream
    assert counter(fleet.kvctl_url, "kvctl_kv_events_applied", status="parent_block_not_found") == 0
    assert counter(fleet.kvctl_url, "kvctl_kv_events_applied", status="block_not_found") == 0
