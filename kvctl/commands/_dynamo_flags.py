"""Dynamo 1.6.1's router flags (`python -m dynamo.frontend --help`) on `kvctl serve`, so that a frontend's command
line can be pasted: each is kvctl's own under another name, already what kvctl does (dropped), or refused by
name with the reason. Never silently ignored: a flag that would change a decision kvctl cannot make is refused.
Flags whose Dynamo name kvctl's options already carry (`--router-prefill-load-scale`, …) are not listed here."""

from __future__ import annotations

from dataclasses import dataclass

from kvctl.errors import UsageError


@dataclass(frozen=True, slots=True)
class DynamoFlag:
    """`kvctl`: kvctl's own option for it (None: nothing to pass). `value`: whether it takes one. `same`: the
    values (or, for a flag, the flag itself: `True`) that are already kvctl's behaviour; any other is refused
    with `why`."""

    kvctl: str | None
    value: bool = False
    same: frozenset[str] | bool = False
    why: str = ""


_NOT_YET = "not implemented yet (issue 38)"
FLAGS: dict[str, DynamoFlag] = {
    # kvctl's own, under Dynamo's name
    "--router-replica-sync": DynamoFlag("--replica-sync"),
    "--router-ttl-secs": DynamoFlag("--router-ttl", value=True),
    "--kv-cache-block-size": DynamoFlag("--block-size", value=True),
    "--no-router-kv-events": DynamoFlag("--approximate"),
    "--no-kv-events": DynamoFlag("--approximate"),
    # already what kvctl does: dropped
    "--no-router-replica-sync": DynamoFlag(None, same=True),
    "--router-kv-events": DynamoFlag(None, same=True),
    "--kv-events": DynamoFlag(None, same=True),
    "--router-track-active-blocks": DynamoFlag(None, same=True),
    "--track-active-blocks": DynamoFlag(None, same=True),
    "--no-router-track-output-blocks": DynamoFlag(None, same=True),
    "--no-track-output-blocks": DynamoFlag(None, same=True),
    "--router-assume-kv-reuse": DynamoFlag(None, same=True),
    "--assume-kv-reuse": DynamoFlag(None, same=True),
    "--no-router-conditional-disagg": DynamoFlag(None, same=True),
    "--no-use-remote-indexer": DynamoFlag(None, same=True),
    "--no-serve-indexer": DynamoFlag(None, same=True),
    "--no-enable-session-prefix-index": DynamoFlag(None, same=True),
    "--no-enforce-disagg": DynamoFlag(None, same=True),
    "--no-load-aware": DynamoFlag(None, same=True),
    "--router-mode": DynamoFlag(None, value=True, same=frozenset({"kv"}),
                                why="kvctl serve is a KV router: it routes as --router-mode kv, and only so"),
    "--router-prefill-load-model": DynamoFlag(None, value=True, same=frozenset({"none"}),
                                              why=f"the ais prefill load model is {_NOT_YET}"),
    "--shared-cache-type": DynamoFlag(None, value=True, same=frozenset({"none"}), why=f"shared caches are {_NOT_YET}"),
    # would change decisions kvctl cannot make yet: refused
    "--no-router-track-active-blocks": DynamoFlag(None, why=f"not tracking active blocks is {_NOT_YET}"),
    "--no-track-active-blocks": DynamoFlag(None, why=f"not tracking active blocks is {_NOT_YET}"),
    "--router-track-output-blocks": DynamoFlag(None, why=f"tracking output blocks is {_NOT_YET}"),
    "--track-output-blocks": DynamoFlag(None, why=f"tracking output blocks is {_NOT_YET}"),
    "--no-router-assume-kv-reuse": DynamoFlag(None, why=f"--no-router-assume-kv-reuse is {_NOT_YET}"),
    "--no-assume-kv-reuse": DynamoFlag(None, why=f"--no-assume-kv-reuse is {_NOT_YET}"),
    "--router-conditional-disagg": DynamoFlag(None, why=f"conditional disaggregation is {_NOT_YET}"),
    "--router-conditional-disagg-config": DynamoFlag(None, value=True,
                                                     why=f"conditional disaggregation is {_NOT_YET}"),
    "--router-prefill-policy": DynamoFlag(None, value=True, why="deprecated in Dynamo: use --router-policy-config"),
    "--router-decode-policy": DynamoFlag(None, value=True, why="deprecated in Dynamo: use --router-policy-config"),
    "--router-min-initial-workers": DynamoFlag(None, value=True, why="kvctl routes from its first worker on"),
    "--router-predicted-ttl-secs": DynamoFlag(None, value=True, why=f"predicted-block TTLs are {_NOT_YET}"),
    "--router-event-threads": DynamoFlag(None, value=True, why="kvctl's index has one writer per model: the "
                                                               "flag would change nothing; drop it"),
    "--use-remote-indexer": DynamoFlag(None, why="kvctl serve is the indexer it routes on"),
    "--serve-indexer": DynamoFlag(None, why="kvctl serve always serves its index (GET /v1/tree)"),
    "--enable-session-prefix-index": DynamoFlag(None, why=f"the session prefix index is {_NOT_YET}"),
    "--shared-cache-multiplier": DynamoFlag(None, value=True, why=f"shared caches are {_NOT_YET}"),
    "--enforce-disagg": DynamoFlag(None, why="deprecated and ignored by Dynamo itself: drop it"),
    "--load-aware": DynamoFlag(None, why="deprecated in Dynamo: kvctl always weighs load"),
    "--event-plane": DynamoFlag(None, value=True, why="kvctl follows an event plane by --nats URL or "
                                                      "--dynamo-discovery STORE"),
    "--discovery-backend": DynamoFlag(None, value=True, why="kvctl reads discovery by --dynamo-discovery "
                                                            "file:DIR, etcd:URL or kubernetes"),
    "--request-plane": DynamoFlag(None, value=True, why="kvctl speaks Dynamo's TCP request plane only, for "
                                                        "recoveries"),
}


def translate(argv: list[str]) -> list[str]:
    """`kvctl serve`'s arguments with Dynamo's flags made kvctl's: renamed, dropped, or refused (UsageError)
    naming the flag and why. Nothing after `--` is touched."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return out + argv[i:]
        name, eq, inline = token.partition("=")
        flag = FLAGS.get(name)
        if flag is None:
            out.append(token)
            i += 1
            continue
        if flag.value and not eq and i + 1 >= len(argv):
            raise UsageError(f"{name} (Dynamo's) needs a value")
        value = (inline if eq else argv[i + 1]) if flag.value else None
        i += 2 if flag.value and not eq else 1
        if flag.kvctl is not None:
            out += [flag.kvctl] + ([value] if value is not None else [])
        elif not (flag.same is True if value is None else isinstance(flag.same, frozenset) and value in flag.same):
            shown = name if value is None else f"{name} {value}"
            raise UsageError(f"{shown} (Dynamo's) is not taken by kvctl serve: {flag.why}")
    return out
