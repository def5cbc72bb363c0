"""Dumps of a radix index read over HTTP from where they live: a kvctl router or Dynamo's standalone indexer
(the sources `kvctl tree` takes, with the JetStream snapshot of `kvctl.nats.jetstream`).

Each returns the dump's RouterEvents; every failure is one of kvctl's errors naming the place, so
`kvctl tree` can take any two sources without caring which is which.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import msgspec

from kvctl import http_api as api
from kvctl.client._base import Request, check, headers, pool_limits, translate, verify_tls
from kvctl.client.deadline import deadline_transport, within
from kvctl.core.events import DecodeError, RouterEvent
from kvctl.core.events.dump_file import DumpFileError, iter_indexer_dump, read_router_events, router_event_of
from kvctl.core.names import DEFAULT_MODEL, format_worker
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


def router_worker_streams(url: str, *, model: str | None, token: str | None,
                          timeout: float) -> dict[str, dict[str, Any]]:
    """What the engine stream of each of a model's workers showed (`GET /v1/workers`: its `groups`,
    `salts_seen` and `events_dropped`), by `ID:DP`; a worker no engine stream follows is left out."""
    text = _get(url, Request("GET", "/v1/workers"), token, timeout)
    try:
        workers = msgspec.json.decode(text, type=api.Workers).workers
    except msgspec.DecodeError:
        raise KvctlError(f"{url}/v1/workers answered no worker list") from None
    wanted = model or DEFAULT_MODEL
    return {format_worker((w.worker_id, w.dp_rank)): {
        "groups": msgspec.to_builtins(w.groups), "salts_seen": w.salts_seen, "events_dropped": w.events_dropped}
        for w in workers if w.model == wanted and w.events_dropped is not msgspec.UNSET}


def dynamo_indexer_events(url: str, *, model: str | None, timeout: float) -> list[RouterEvent]:
    """One model of a Dynamo standalone indexer's `GET /dump`, whole (see `dynamo_indexer_stream`)."""
    with dynamo_indexer_stream(url, model=model, timeout=timeout) as events:
        return list(events)


@contextmanager
def dynamo_indexer_stream(url: str, *, model: str | None, timeout: float) -> Iterator[Iterator[RouterEvent]]:
    """One model of a Dynamo standalone indexer's `GET /dump`, `{"model:routing_group": {"events": [...]}}`,
    each event as it arrives: a reader holds one event and one piece of the answer at a time.

    With no model named, the indexer's only model (none: an empty dump); `model` matches the name
    with or without its routing group. The events are read inside the `with`, all within `timeout`.
    """
    with _streamed(url, Request("GET", "/dump"), None, timeout) as text:
        yield _indexer_events(iter_indexer_dump(text), url, model)


def _indexer_events(models: Iterator[tuple[str, Iterator[Any]]], url: str, model: str | None) -> Iterator[RouterEvent]:
    seen: list[str] = []
    try:
        for name, items in models:
            seen.append(name)
            if model is None and len(seen) > 1:
                seen.extend(name for name, _ in models)
                raise UsageError(f"{url} indexes several models: {', '.join(sorted(seen))}",
                                 hint="pick one with --model")
            if model is None or model in (name, name.rsplit(":", 1)[0]):
                yield from (_decode(item, url) for item in items)
    except DumpFileError as exc:
        raise KvctlError(f"{url}/dump: {exc}") from None
    if model is not None and not any(model in (name, name.rsplit(":", 1)[0]) for name in seen):
        raise NotFound(f"{url} has no model {model!r} (it has: {', '.join(sorted(seen)) or 'none'})", status=404)


def _get(url: str, request: Request, token: str | None, timeout: float) -> str:
    """One GET, the whole of it (a dump of millions of blocks too) within `timeout`."""
    with _streamed(url, request, token, timeout) as text:
        return "".join(text)


@contextmanager
def _streamed(url: str, request: Request, token: str | None, timeout: float) -> Iterator[Iterator[str]]:
    """One GET's answer as text arriving in pieces; a failure status is the error it stands for. Read inside
    the `with`: the whole of it within `timeout`."""
    transport = deadline_transport(verify=verify_tls(url), limits=pool_limits())
    with (translate(url), within(timeout),
          httpx.Client(base_url=url, headers=headers(token), timeout=timeout, transport=transport) as http,
          http.stream(request.method, request.path, params=request.params) as response):
        if not response.is_success:
            response.read()
            check(request, response)
        yield response.iter_text()


def _decode(item: Any, url: str) -> RouterEvent:
    if not isinstance(item, dict):
        raise KvctlError(f"{url}/dump: expected a RouterEvent object, got {type(item).__name__}")
    try:
        return router_event_of(item)
    except DecodeError as exc:
        raise KvctlError(f"{url}/dump: {exc.field}: {exc.detail}") from None
