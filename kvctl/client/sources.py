"""Dumps of a radix index read from where they live: a kvctl router, Dynamo's standalone indexer, or the
JetStream snapshot a durable router leaves in its object store (the sources `kvctl tree` takes).

Each returns the dump's RouterEvents; every failure is one of kvctl's errors naming the place, so
`kvctl tree` can take any two sources without caring which is which.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import httpx

from kvctl.client._base import DEFAULT_MODEL, Call, headers, interpret, pool_limits, translate, verify_tls
from kvctl.client.deadline import deadline_transport, within
from kvctl.core.events import DecodeError, RouterEvent, decode_router_event_json
from kvctl.core.events.dump_file import DumpFileError, read_router_events
from kvctl.errors import KvctlError, NotFound, UsageError

if TYPE_CHECKING:  # NATS is loaded only by the snapshot source: an HTTP dump is the common case
    from kvctl.core.events.plane import PlaneNames
    from kvctl.natsconn import NatsConnection


def router_events(url: str, *, model: str | None, token: str | None, timeout: float) -> list[RouterEvent]:
    """A kvctl router's index of one model (`GET /v1/tree?format=jsonl`)."""
    text = _get(url, Call("GET", "/v1/tree", params={"model": model or DEFAULT_MODEL, "format": "jsonl"}),
                token, timeout)
    try:
        return read_router_events(text)
    except DumpFileError as exc:
        raise KvctlError(f"{url} answered a malformed dump: {exc}") from None


def router_tree_stats(url: str, *, model: str | None, top: int, token: str | None,
                      timeout: float) -> dict[str, Any] | None:
    """One model's `kvctl tree stats` object computed by the router itself (`GET /v1/tree/stats?shape=true`);
    None from a router too old to compute it, whose dump is then the way."""
    params = {"model": model or DEFAULT_MODEL, "shape": "true", "top": str(top)}
    text = _get(url, Call("GET", "/v1/tree/stats", params=params), token, timeout)
    try:
        stats = json.loads(text)["models"][model or DEFAULT_MODEL]
    except (ValueError, KeyError, TypeError):
        raise KvctlError(f"{url}/v1/tree/stats answered no stats of model {model or DEFAULT_MODEL!r}") from None
    return stats if isinstance(stats, dict) and "paths" in stats else None


def dynamo_indexer_events(url: str, *, model: str | None, timeout: float) -> list[RouterEvent]:
    """One model of a Dynamo standalone indexer's `GET /dump`: `{"model:routing_group": {"events": [...]}}`.

    With no model named, the indexer's only model (none: an empty dump); `model` matches the name
    with or without its routing group.
    """
    try:
        dump = json.loads(_get(url, Call("GET", "/dump"), None, timeout) or "{}")
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise KvctlError(f"{url}/dump is not JSON: {exc}") from None
    if not isinstance(dump, dict):
        raise KvctlError(f"{url}/dump is not a Dynamo indexer dump (expected an object by model)")
    if model is None:
        if len(dump) > 1:
            raise UsageError(f"{url} indexes several models: {', '.join(sorted(dump))}", hint="pick one with --model")
        chosen = list(dump.values())
    else:
        chosen = [v for k, v in dump.items() if model in (k, k.rsplit(":", 1)[0])]
        if not chosen:
            raise NotFound(f"{url} has no model {model!r} (it has: {', '.join(sorted(dump)) or 'none'})",
                           status=404)
    return [_decode(item, url) for entry in chosen for item in _events_of(entry, url)]


def nats_snapshot_events(conn: NatsConnection, names: PlaneNames) -> list[RouterEvent]:
    """The `radix-state` object of a durable router's snapshot bucket: RouterEvent JSON lines."""
    import asyncio

    from kvctl.core.events.plane import RADIX_STATE_OBJECT

    data = asyncio.run(_read_object(conn, names.bucket))
    try:
        return read_router_events(data.decode())
    except (DumpFileError, UnicodeDecodeError) as exc:
        raise KvctlError(f"{names.bucket}/{RADIX_STATE_OBJECT} on {conn.shown_url} is not a dump: {exc}") from None


def _get(url: str, call: Call, token: str | None, timeout: float) -> str:
    """One GET, the whole of it (a dump of millions of blocks too) within `timeout`."""
    transport = deadline_transport(verify=verify_tls(url), limits=pool_limits())
    with (translate(url), within(timeout),
          httpx.Client(base_url=url, headers=headers(token), timeout=timeout, transport=transport) as http):
        response = http.request(call.method, call.path, params=call.params)
    if not response.is_success:
        interpret(call, response)  # raises the error the status stands for
    return response.text


def _events_of(entry: Any, url: str) -> list[Any]:
    events = entry.get("events") if isinstance(entry, dict) else None
    if not isinstance(events, list):
        raise KvctlError(f"{url}/dump: a model without an events list")
    return events


def _decode(item: Any, url: str) -> RouterEvent:
    if not isinstance(item, dict):
        raise KvctlError(f"{url}/dump: expected a RouterEvent object, got {type(item).__name__}")
    try:
        return decode_router_event_json(item)
    except DecodeError as exc:
        raise KvctlError(f"{url}/dump: {exc.field}: {exc.detail}") from None


async def _read_object(conn: NatsConnection, bucket: str) -> bytes:
    import nats
    import nats.js.errors

    from kvctl.core.events.plane import RADIX_STATE_OBJECT
    from kvctl.natsconn import connect

    nc = await connect(conn)
    try:
        store = await nc.jetstream().object_store(bucket)
        return (await store.get(RADIX_STATE_OBJECT)).data or b""
    except (nats.js.errors.NotFoundError, nats.js.errors.BucketNotFoundError, nats.js.errors.ObjectNotFoundError):
        raise NotFound(f"no snapshot {bucket}/{RADIX_STATE_OBJECT} on {conn.shown_url}", status=404,
                       hint="a durable router writes one only once its stream passes --snapshot-threshold") from None
    finally:
        await nc.close()

