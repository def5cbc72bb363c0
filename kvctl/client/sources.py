"""Dumps of a radix index read over HTTP from where they live: a kvctl router or Dynamo's standalone indexer
(the sources `kvctl tree` takes, with the JetStream snapshot of `kvctl.nats.jetstream`).

Each returns the dump's RouterEvents; every failure is one of kvctl's errors naming the place, so
`kvctl tree` can take any two sources without caring which is which.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgspec

from kvctl import http_api as api
from kvctl.client._base import Request, check, headers, pool_limits, translate, verify_tls
from kvctl.client.deadline import deadline_transport, within
from kvctl.core.events import DecodeError, RouterEvent, decode_router_event_json
from kvctl.core.events.dump_file import DumpFileError, read_router_events
from kvctl.core.names import DEFAULT_MODEL
from kvctl.errors import KvctlError, NotFound, UsageError


def router_events(url: str, *, model: str | None, token: str | None, timeout: float) -> list[RouterEvent]:
    """A kvctl router's index of one model (`GET /v1/tree?format=jsonl`)."""
    text = _get(url, Request("GET", "/v1/tree", params={"model": model or DEFAULT_MODEL, "format": "jsonl"}),
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
    text = _get(url, Request("GET", "/v1/tree/stats", params=params), token, timeout)
    try:
        stats = msgspec.json.decode(text, type=api.TreeStats).models[model or DEFAULT_MODEL]
    except (msgspec.DecodeError, KeyError):  # msgspec.ValidationError is a DecodeError
        raise KvctlError(f"{url}/v1/tree/stats answered no stats of model {model or DEFAULT_MODEL!r}") from None
    return msgspec.to_builtins(stats) if stats.paths is not msgspec.UNSET else None


def dynamo_indexer_events(url: str, *, model: str | None, timeout: float) -> list[RouterEvent]:
    """One model of a Dynamo standalone indexer's `GET /dump`: `{"model:routing_group": {"events": [...]}}`.

    With no model named, the indexer's only model (none: an empty dump); `model` matches the name
    with or without its routing group.
    """
    try:
        dump = json.loads(_get(url, Request("GET", "/dump"), None, timeout) or "{}")
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


def _get(url: str, request: Request, token: str | None, timeout: float) -> str:
    """One GET, the whole of it (a dump of millions of blocks too) within `timeout`."""
    transport = deadline_transport(verify=verify_tls(url), limits=pool_limits())
    with (translate(url), within(timeout),
          httpx.Client(base_url=url, headers=headers(token), timeout=timeout, transport=transport) as http):
        response = http.request(request.method, request.path, params=request.params)
    check(request, response)
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
