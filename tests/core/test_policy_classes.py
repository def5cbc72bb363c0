"""`--router-policy-config`'s policy classes (issue 38): which class a request falls in, which profile applies,
and each file Dynamo 1.6.1 refuses, refused with its message (taken from the 1.6.1 binary and its
`SelectionService` run on each file)."""

from __future__ import annotations

import pytest

from kvctl.core.router.policy_classes import QueueProfiles, synthetic
from kvctl.core.router.policy_config import PolicyConfigError, parse_policy_config
from kvctl.core.router.queue import QueuePolicy, RouterQueue

PROFILE = """
default_policy_family: standard
uncached_isl_buckets:
  - {min_tokens: 0, bucket: cached}
  - {min_tokens: 32, bucket: uncached}
policy_classes:
  - {name: std_cached, policy_family: standard, cache_bucket: cached, queue_policy: wspt, quantum: 4,
     prefill_busy_threshold: 10}
  - {name: std_uncached, policy_family: standard, cache_bucket: uncached, quantum: 8,
     prefill_busy_threshold_frac: 0.5}
  - {name: vip, quantum: 2, prefill_busy_threshold_frac: 2.0}
"""


def test_a_request_falls_in_its_familys_class_for_its_uncached_tokens() -> None:
    root = parse_policy_config(PROFILE).root
    assert root is not None
    assert root.classify(31).name == "std_cached" and root.classify(32).name == "std_uncached"  # inclusive
    assert root.classify(5, "vip").name == "vip"  # an explicit class, by name
    assert root.classify(5, "std_uncached").name == "std_cached"  # a bound class's name selects nothing
    assert root.classify(40, "nosuch").name == "std_uncached"  # unknown: the default family
    cls = root.classify(0)
    assert (cls.queue_policy, cls.quantum, cls.prefill_busy_threshold, cls.prefill_busy_threshold_frac) == (
        QueuePolicy.wspt, 4, 10, None)


def test_a_models_profile_wins_then_the_roots_then_the_flags() -> None:
    other = PROFILE.replace("std_", "m_").replace("standard", "mine")
    config = parse_policy_config(PROFILE + "models:\n  m:\n" + "".join(f"    {line}\n" for line in
                                                                        other.strip().splitlines()))
    profiles = QueueProfiles(synthetic(RouterQueue(0.3)), config.root, config.models)
    assert profiles.profile("m").classify(0).name == "m_cached"
    assert profiles.profile("other").classify(0).name == "std_cached"
    flags = QueueProfiles(synthetic(RouterQueue(0.3, QueuePolicy.wspt))).profile("m").classify(10**6)
    assert (flags.name, flags.prefill_busy_threshold_frac, flags.queue_policy) == ("default", 0.3, QueuePolicy.wspt)
    assert profiles.status() == {"threshold": 0.3, "policy": "fcfs", "profiles": {
        "root": ["std_cached", "std_uncached", "vip"], "model m": ["m_cached", "m_uncached", "vip"]}}


ROOT = "invalid router policy config: root "


@pytest.mark.parametrize(("text", "message"), [
    ("default_policy_family: standard\n", "invalid router policy config: root profile must specify "
     "default_policy_family, uncached_isl_buckets, and policy_classes when any root profile field is present"),
    (PROFILE.replace("quantum: 8", "quantum: 0"), ROOT + 'policy class "std_uncached" quantum must be greater '
     "than zero"),
    (PROFILE.replace("queue_policy: wspt", "queue_policy: lcfs"), ROOT + 'policy class "std_cached" queue_policy '
     "must be fcfs or wspt"),
    (PROFILE.replace("prefill_busy_threshold_frac: 0.5", "prefill_busy_threshold_frac: -1"),
     ROOT + 'policy class "std_uncached" prefill_busy_threshold_frac must be finite and non-negative'),
    (PROFILE.replace("cache_bucket: uncached,", "cache_bucket: nope,"), ROOT + 'policy class "std_uncached" '
     'references unknown cache bucket "nope"'),
    (PROFILE.replace("{name: vip,", "{name: vip, policy_family: standard,"), ROOT + 'policy class "vip" must '
     "specify both policy_family and cache_bucket or neither for an explicit class"),
    (PROFILE.replace("{min_tokens: 0,", "{min_tokens: 1,"), ROOT + "uncached_isl_buckets must start at min_tokens 0"),
    (PROFILE.replace("min_tokens: 32", "min_tokens: 0"), ROOT + "uncached_isl_buckets min_tokens must be strictly "
     "increasing"),
    (PROFILE.replace("default_policy_family: standard", "default_policy_family: other"), ROOT +
     'default_policy_family "other" does not name a configured family'),
    (PROFILE.replace("{name: vip,", "{name: standard,"), ROOT + 'explicit policy class "standard" collides with a '
     "policy family"),
    (PROFILE.replace("cache_bucket: uncached,", "cache_bucket: cached,"), ROOT + 'contains duplicate policy classes '
     'for family "standard" and bucket "cached"'),
    (PROFILE.replace("name: std_uncached", "name: std_cached"), ROOT + 'contains duplicate policy class '
     '"std_cached"'),
    (PROFILE.replace("quantum: 8,", ""), "failed to parse router policy config: policy_classes[1]: missing field "
     "`quantum`"),
    ("models:\n  m: {default_policy_family: f}\n", "failed to parse router policy config: models.m: missing field "
     "`uncached_isl_buckets`"),
])
def test_a_profile_dynamo_refuses_is_refused_with_its_words(text: str, message: str) -> None:
    with pytest.raises(PolicyConfigError) as refused:
        parse_policy_config(text)
    assert str(refused.value) == message


def test_a_family_missing_a_bucket_is_named() -> None:
    text = PROFILE.replace("  - {name: vip,", "  - {name: x, policy_family: other, cache_bucket: cached, quantum: 1}\n"
                                             "  - {name: vip,")
    with pytest.raises(PolicyConfigError, match='root is missing a policy class for family "other" and bucket '
                                                '"uncached"'):
        parse_policy_config(text)
