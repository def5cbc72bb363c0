"""`kvctl serve --router-policy-config` with a `router:` section (issue 44): its settings over serve's flags, as
Dynamo 1.6.1 puts them over its own; what Dynamo refuses refused by name, exit 2 on one line; what kvctl cannot
apply refused or warned of by name, never a blanket "ignores router"."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvctl.commands._serve_routing import FleetOptions, TrackingHash, fleet_options, read_policy, router_config
from kvctl.core.router.approx_lru import CachePolicy
from kvctl.errors import UsageError
from tests.server.test_serve_process import refused, serving

FLAGS = FleetOptions(approximate=False, router_ttl=120.0, cache_policy=CachePolicy.ttl,
                     tracking_hash=TrackingHash.public, tracking_key_file=None, tracking_key_id=None,
                     replica_sync=False)


def policy_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text("router:\n" + "".join(f"  {line}\n" for line in body.splitlines()))
    return path


def options(tmp_path: Path, body: str, flags: FleetOptions = FLAGS, track: bool | None = None) -> FleetOptions:
    path = policy_file(tmp_path, body)
    return fleet_options(flags, track, read_policy(path), path)


def test_the_section_s_settings_win_over_serve_s_options(tmp_path: Path) -> None:
    flags = FleetOptions(approximate=True, router_ttl=30.0, cache_policy=CachePolicy.ttl,
                         tracking_hash=TrackingHash.public, tracking_key_file=None, tracking_key_id=None,
                         replica_sync=True)
    assert options(tmp_path, "use_kv_events: false\nrouter_ttl_secs: 45\nrouter_approximate_cache_policy: lru\n"
                             "router_replica_sync: false") == FleetOptions(
        approximate=True, router_ttl=45.0, cache_policy=CachePolicy.lru, tracking_hash=TrackingHash.public,
        tracking_key_file=None, tracking_key_id=None, replica_sync=False)
    assert options(tmp_path, "use_kv_events: true", flags).approximate is False  # over --approximate
    assert options(tmp_path, "router_replica_sync: true").replica_sync is True
    assert options(tmp_path, "host_cache_hit_weight: 0.5") == FLAGS  # a knob: router_config's
    assert fleet_options(flags, None, None, None) == flags  # no file


def test_tracking_settings_combine_with_the_flags_as_in_dynamo(tmp_path: Path) -> None:
    key = tmp_path / "key"
    flags = FleetOptions(approximate=False, router_ttl=120.0, cache_policy=CachePolicy.ttl,
                         tracking_hash=TrackingHash.public, tracking_key_file=key, tracking_key_id="k1",
                         replica_sync=False)
    keyed = options(tmp_path, "router_tracking_hash: keyed-xxh3-v1", flags)
    assert (keyed.tracking_hash, keyed.tracking_key_file, keyed.tracking_key_id) == (TrackingHash.keyed, key, "k1")
    in_file = options(tmp_path, f"router_tracking_hash: keyed-xxh3-v1\nrouter_tracking_key_file: {key}\n"
                                "router_tracking_key_id: k2")
    assert (in_file.tracking_key_file, in_file.tracking_key_id) == (key, "k2")


@pytest.mark.parametrize(("body", "flags", "message"), [
    ("router_tracking_hash: keyed-xxh3-v1", FLAGS, "keyed-xxh3-v1 requires router_tracking_key_file"),
    ("router_approximate_cache_policy: lru", FLAGS,
     "router_approximate_cache_policy=lru requires use_kv_events=false; the local side indexer is TTL-only"),
    ("use_kv_events: true", FleetOptions(True, 120.0, CachePolicy.lru, TrackingHash.public, None, None, False),
     "router_approximate_cache_policy=lru requires use_kv_events=false"),  # the file turns --approximate off
    ("router_track_output_blocks: true", FLAGS, "router.router_track_output_blocks: true is not taken by kvctl serve: "
                                                "tracking output blocks is not implemented in kvctl yet"),
    ("use_kv_events: false\nrouter_ttl_secs: 0", FLAGS,
     "router.router_ttl_secs: 0.0 is not taken by kvctl serve: its approximate mode needs a TTL > 0"),
])
def test_what_cannot_be_applied_is_a_usage_error_naming_the_setting(tmp_path: Path, body: str, flags: FleetOptions,
                                                                     message: str) -> None:
    with pytest.raises(UsageError) as caught:
        options(tmp_path, body, flags)
    assert str(caught.value).startswith(f"--router-policy-config {tmp_path / 'policy.yaml'}: {message}")


def test_settings_that_change_no_decision_are_warned_of_by_name(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvctl.serve"):
        options(tmp_path, "router_event_threads: 8\nuse_remote_indexer: true\nrouter_ttl_secs: 60")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "--router-policy-config: router.router_event_threads: 8: kvctl's index has one writer per model: no effect",
        "--router-policy-config: router.use_remote_indexer: true: kvctl routes on its own index of the fleet's KV "
        "events, which equals the workers'"]
    applied = [r.getMessage() for r in caplog.records if "applied" in r.getMessage()]
    assert applied == ["--router-policy-config: router settings applied over the flags: router_event_threads=8, "
                       "use_remote_indexer=true, router_ttl_secs=60.0"]
    assert not any("ignores" in r.getMessage() for r in caplog.records)


def test_the_section_s_knobs_win_over_the_flags_and_tier_credits(tmp_path: Path) -> None:
    path = policy_file(tmp_path, "host_cache_hit_weight: 0.5\nrouter_track_prefill_tokens: false")
    flags: dict[str, float | bool | None] = {"host_cache_hit_weight": 0.9, "track_prefill_tokens": True}
    config, _ = router_config(flags, None, "host_pinned=0.6,disk=0.3", path, None)
    assert (config.host_cache_hit_weight, config.disk_cache_hit_weight, config.track_prefill_tokens) == (
        0.5, 0.3, False)
    policy = read_policy(path)
    assert router_config(flags, None, None, policy, None)[0] == router_config(flags, None, None, path, None)[0]


def test_a_section_dynamo_refuses_exits_2_on_one_line(tmp_path: Path) -> None:
    path = policy_file(tmp_path, "router_track_prefill_tokens: yes")
    code, _, err = refused("--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
                           "--router-policy-config", str(path))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"--router-policy-config {path}: invalid router policy config: router.router_track_prefill_tokens: " \
           'invalid type: string "yes", expected a boolean' in err


def test_a_served_router_routes_with_the_section_s_settings(tmp_path: Path) -> None:
    """No KV events (approximate: a booked route indexes its prompt) and no prefill tracking, from the file."""
    path = policy_file(tmp_path, "use_kv_events: false\nrouter_track_prefill_tokens: false\nhost_cache_hit_weight: 0.5")
    tokens = list(range(64))  # 4 blocks of 16
    with serving(tmp_path / "state", "--router-policy-config", str(path)) as (_, client):
        for worker_id in (1, 2):
            client.post("/v1/workers", json={"worker_id": worker_id}).raise_for_status()
        first = client.post("/v1/route", json={"token_ids": tokens, "explain": True, "reserve": True,
                                               "request_id": "a"}).raise_for_status().json()
        assert {c["logit"] for c in first["candidates"]} == {4.0}  # decode blocks only: no prompt prefill
        client.delete("/v1/requests/a").raise_for_status()
        again = client.post("/v1/route", json={"token_ids": tokens, "explain": True}).raise_for_status().json()
    logits = {c["worker_id"]: (c["overlap_blocks"], c["logit"]) for c in again["candidates"]}
    assert logits == {first["worker_id"]: (4, 0.0), 3 - first["worker_id"]: (0, 4.0)}  # its own route, indexed
