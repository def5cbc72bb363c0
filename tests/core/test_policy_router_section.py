"""The `router:` section of `--router-policy-config` (issue 44): each setting read, converted and refused as a
Dynamo 1.6.1 frontend does (the messages are the frontend's, taken from `python -m dynamo.frontend` started on each
file; tests/interop/test_policy_router_frontend.py checks them against it live), and what kvctl makes of each."""

from __future__ import annotations

import re

import pytest

from kvctl.core.router.policy_config import PolicyConfigError, parse_policy_config
from kvctl.core.router.router_section import (
    DEFAULTS,
    SETTINGS,
    combination_error,
    inert,
    kvctl_refusal,
)
from kvctl.core.router.scoring import RouterConfig


def section(body: str) -> dict[str, object]:
    return parse_policy_config("router:\n" + "".join(f"  {line}\n" for line in body.splitlines())).router


def test_settings_are_converted_as_dynamo_s_python_converts_them() -> None:
    assert section("host_cache_hit_weight: 1\nrouter_ttl_secs: 5\nrouter_track_prefill_tokens: false\n"
                   "router_tracking_key_id: null\nrouter_event_threads: 2") == {
        "host_cache_hit_weight": 1.0, "router_ttl_secs": 5.0, "router_track_prefill_tokens": False,
        "router_tracking_key_id": None, "router_event_threads": 2}
    assert isinstance(section("disk_cache_hit_weight: 0")["disk_cache_hit_weight"], float)
    assert section("router_ttl_secs: 1\nrouter_ttl_secs: 2") == {"router_ttl_secs": 2.0}  # the last one, as Dynamo
    assert parse_policy_config("router: {}\n").router == {}  # defines router settings: accepted, sets nothing


def test_the_section_is_no_longer_reported_as_ignored() -> None:
    policy = parse_policy_config("router:\n  host_cache_hit_weight: 0.5\nrequest_classifier: {type: x}\n")
    assert policy.ignored == ["request_classifier"]


@pytest.mark.parametrize(("body", "message"), [
    # Dynamo's Python: the mapping, unknown keys (sorted), msgspec's types (kvctl adds where: `- at $.key`)
    ("bogus: 1", "unknown router setting(s): ['bogus']"),
    ("zeta: 1\nalpha: 2", "unknown router setting(s): ['alpha', 'zeta']"),
    ("overlap_score_credit: 0.5", "unknown router setting(s): ['overlap_score_credit']"),  # a policy parameter
    ("router_temperature: 0.5", "unknown router setting(s): ['router_temperature']"),
    ("host_cache_hit_weight: '0.5'", "invalid router settings: Expected `float`, got `str` - at "
                                     "`$.host_cache_hit_weight`"),
    ("host_cache_hit_weight: true", "invalid router settings: Expected `float`, got `bool`"),
    ("host_cache_hit_weight: null", "invalid router settings: Expected `float`, got `null`"),
    ("router_ttl_secs: [1]", "invalid router settings: Expected `float`, got `array`"),
    ("router_ttl_secs: 1e3", "invalid router settings: Expected `float`, got `str`"),  # YAML 1.1: a string
    ("router_track_prefill_tokens: 0", "invalid router settings: Expected `bool`, got `int`"),
    ("router_track_prefill_tokens: 'false'", "invalid router settings: Expected `bool`, got `str`"),
    ("router_event_threads: 2.0", "invalid router settings: Expected `int`, got `float`"),
    ("router_tracking_hash: 3", "invalid router settings: Expected `str`, got `int`"),
    ("router_tracking_hash: yes", "invalid router settings: Expected `str`, got `bool`"),
    ("router_tracking_key_id: 7", "invalid router settings: Expected `str | null`, got `int`"),
    ("router_tracking_key_id: 2024-01-01", "invalid router settings: Expected `str | null`, got `date`"),
    ("router_predicted_ttl_secs: x", "invalid router settings: Expected `float | null`, got `str`"),
    # the frontend's own checks, then Rust's as the values are passed on: integer range, enums
    ("serve_indexer: true\nuse_remote_indexer: true\nrouter_ttl_secs: -1",
     "--serve-indexer and --use-remote-indexer are mutually exclusive"),
    ("router_event_threads: -1", "out of range integral type conversion attempted"),
    ("router_event_threads: 5000000000", "out of range integral type conversion attempted"),
    ("router_tracking_hash: sha", 'router_tracking_hash must be public-xxh3-v1 or keyed-xxh3-v1, got "sha"'),
    ("router_tracking_hash: 1e3", 'router_tracking_hash must be public-xxh3-v1 or keyed-xxh3-v1, got "1e3"'),
    ("router_prefill_load_model: bogus", "unknown prefill load model: \"bogus\", expected 'none' or 'ais'"),
    ("shared_cache_type: redis", "unknown shared_cache_type: \"redis\", expected 'none' or 'hicache'"),
    ("router_approximate_cache_policy: fifo", "unknown approximate cache policy \"fifo\", expected 'ttl' or 'lru'"),
    ("router_tracking_hash: sha\nuse_kv_events: off",
     'router_tracking_hash must be public-xxh3-v1 or keyed-xxh3-v1, got "sha"'),
    # Rust reads the section again as YAML 1.2: where 1.1 and 1.2 disagree
    ("router_track_prefill_tokens: yes", 'invalid router policy config: router.router_track_prefill_tokens: '
                                         'invalid type: string "yes", expected a boolean'),
    ("router_ttl_secs: -1\nuse_kv_events: off",
     'invalid router policy config: router.use_kv_events: invalid type: string "off", expected a boolean'),
    ("router_ttl_secs: 1_000.5",
     'invalid router policy config: router.router_ttl_secs: invalid type: string "1_000.5", expected f64'),
    ("router_ttl_secs: 1:30",
     'invalid router policy config: router.router_ttl_secs: invalid type: string "1:30", expected f64'),
    ("router_event_threads: 1_000",
     'invalid router policy config: router.router_event_threads: invalid type: string "1_000", expected u32'),
    ("disk_cache_hit_weight: .nan",
     "invalid router policy config: router.disk_cache_hit_weight: invalid type: null, expected f64"),
    ("router_ttl_secs: .inf", "invalid router policy config: router.router_ttl_secs: invalid type: null, expected f64"),
    # then Rust's ranges
    ("host_cache_hit_weight: -1", "host_cache_hit_weight must be between 0 and 1"),
    ("host_cache_hit_weight: 1.5", "host_cache_hit_weight must be between 0 and 1"),
    ("router_ttl_secs: -1\nhost_cache_hit_weight: 2", "host_cache_hit_weight must be between 0 and 1"),
    ("disk_cache_hit_weight: 2\nrouter_ttl_secs: -1", "disk_cache_hit_weight must be between 0 and 1"),
    ("router_ttl_secs: -1", "router_ttl_secs must be greater than or equal to 0"),
    ("router_event_threads: 0\nrouter_ttl_secs: -1", "router_ttl_secs must be greater than or equal to 0"),
    ("router_event_threads: 0", "router_event_threads must be at least 1"),
    ("router_predicted_ttl_secs: -3", "router_predicted_ttl_secs must be greater than or equal to 0"),
])
def test_a_section_dynamo_refuses_is_refused_with_its_words(body: str, message: str) -> None:
    with pytest.raises(PolicyConfigError) as refused:
        section(body)
    assert str(refused.value).startswith(message), str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(("text", "message"), [
    ("router: 3\n", "router must contain a YAML mapping"),
    ("router: [1]\n", "router must contain a YAML mapping"),
    ("router:\n  bogus: 1\nworker_selection: {colour: red}\n", "unknown router setting(s): ['bogus']"),  # first
])
def test_the_section_is_checked_first_and_must_be_a_mapping(text: str, message: str) -> None:
    with pytest.raises(PolicyConfigError, match=f"^{re.escape(message)}$"):
        parse_policy_config(text)


def test_a_null_section_defines_nothing() -> None:
    with pytest.raises(PolicyConfigError, match="must define router settings"):
        parse_policy_config("router:\n")


def merged(**settings: object) -> dict[str, object]:
    return {**DEFAULTS, **settings}


@pytest.mark.parametrize(("settings", "message"), [
    ({"router_tracking_key_id": "k"}, "router tracking key options require router_tracking_hash=keyed-xxh3-v1"),
    ({"router_tracking_hash": "keyed-xxh3-v1", "router_tracking_key_id": "k"},
     "keyed-xxh3-v1 requires router_tracking_key_file"),
    ({"router_tracking_hash": "keyed-xxh3-v1", "router_tracking_key_file": "/k", "router_tracking_key_id": " k"},
     "keyed-xxh3-v1 requires a nonempty router_tracking_key_id"),
    ({"router_tracking_hash": "keyed-xxh3-v1", "router_approximate_cache_policy": "lru"},
     "keyed-xxh3-v1 requires router_tracking_key_file"),
    ({"router_track_output_blocks": True, "router_track_active_blocks": False,
      "router_approximate_cache_policy": "lru"},
     "router_track_output_blocks requires router_track_active_blocks=true"),
    ({"router_prefill_load_model": "aic", "router_track_prefill_tokens": False},
     "router_prefill_load_model requires router_track_prefill_tokens=true"),
    ({"enable_session_prefix_index": True, "use_kv_events": False, "router_predicted_ttl_secs": 3.0},
     "enable_session_prefix_index requires use_kv_events=true"),
    ({"use_kv_events": False, "router_approximate_cache_policy": "lru", "router_predicted_ttl_secs": 3.0},
     "router_predicted_ttl_secs requires use_kv_events=true"),
    ({"router_approximate_cache_policy": "lru"},
     "router_approximate_cache_policy=lru requires use_kv_events=false; the local side indexer is TTL-only"),
])
def test_settings_that_do_not_go_together_are_refused_in_dynamo_s_order(settings: dict[str, object],
                                                                           message: str) -> None:
    assert combination_error(merged(**settings)) == message


def test_settings_that_go_together_pass() -> None:
    assert combination_error(merged()) is None
    assert combination_error(merged(use_kv_events=False, router_approximate_cache_policy="lru")) is None
    assert combination_error(merged(router_tracking_hash="keyed-xxh3-v1", router_tracking_key_file="/k",
                                    router_tracking_key_id="k1")) is None


@pytest.mark.parametrize(("body", "reason"), [
    ("router_track_active_blocks: false", "router.router_track_active_blocks: false is not taken by kvctl serve: "
                                          "a router tracking no active blocks is not implemented"),
    ("router_track_output_blocks: true", "router.router_track_output_blocks: true is not taken"),
    ("router_assume_kv_reuse: false", "router.router_assume_kv_reuse: false is not taken"),
    ("router_prefill_load_model: aic", "router.router_prefill_load_model: aic is not taken"),
    ("shared_cache_type: hicache", "router.shared_cache_type: hicache is not taken"),
    ("router_predicted_ttl_secs: 10", "router.router_predicted_ttl_secs: 10.0 is not taken"),
])
def test_a_setting_that_would_change_decisions_kvctl_cannot_make_is_refused_by_name(body: str, reason: str) -> None:
    refusal = kvctl_refusal(section(body))
    assert refusal is not None and refusal.startswith(reason), refusal


def test_settings_at_dynamo_s_defaults_or_kvctl_s_own_need_nothing() -> None:
    defaults = {key: value for key, value in DEFAULTS.items()}
    assert kvctl_refusal(defaults) is None and inert(defaults) == []
    assert set(SETTINGS) == set(DEFAULTS) and len(SETTINGS) == 20


def test_a_setting_that_changes_none_of_kvctl_s_decisions_is_named_with_why() -> None:
    lines = inert(section("router_event_threads: 8\nserve_indexer: true\nenable_session_prefix_index: true"))
    assert [line.split(":")[0] for line in lines] == [
        "router.router_event_threads", "router.serve_indexer", "router.enable_session_prefix_index"]
    assert lines[0] == "router.router_event_threads: 8: kvctl's index has one writer per model: no effect"
    assert inert(section("use_remote_indexer: true"))[0].startswith("router.use_remote_indexer: true: kvctl routes")


def test_the_section_s_knobs_win_over_the_flags_and_lose_to_the_instance() -> None:
    flags = RouterConfig(host_cache_hit_weight=0.9, disk_cache_hit_weight=0.05, track_prefill_tokens=True)
    policy = parse_policy_config("router:\n  host_cache_hit_weight: 0.5\n  router_track_prefill_tokens: false\n")
    config = policy.apply(flags)
    assert (config.host_cache_hit_weight, config.disk_cache_hit_weight, config.track_prefill_tokens) == (
        0.5, 0.05, False)
    assert config.booked_tier_weights is None

    instance = ("worker_selection:\n  aggregated: a\n  instances:\n    - name: a\n      type: dynamo-default-cost-fn\n"
                "      parameters: {host_cache_hit_weight: 0.2}\n")
    config = parse_policy_config("router:\n  host_cache_hit_weight: 0.5\n" + instance).apply(flags)
    assert config.host_cache_hit_weight == 0.2  # the instance scores
    assert config.booked_tier_weights == (0.5, 0.05)  # the router-wide weights (the section's) book
