"""Dynamo's etcd discovery backend (docs/contract.md): `--dynamo-discovery etcd:URL[,URL...]`.

etcd holds Dynamo's keys (no leading slash) and values, bound to their owner's lease. They are read through etcd's
JSON gateway (`/v3/kv/range` and `/v3/watch`, v3.4 and later), trying each URL in turn, and this router's own are
written under a lease of its own. Every call has a deadline from connect to last byte (a store that trickles
its answer fails the call, which is retried), and every answer a size cap: a range lists the keys first, then
reads their values PAGE_KEYS at a time, each page at most PAGE_KEYS records of MAX_RECORD_BYTES; a page past it is
read again key by key, and the key too large is skipped, counted, and left out of later ranges while its revision
stays. A 200 MB value costs a few capped reads, once, not 200 MB at each range.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from kvctl.errors import DiscoveryError
from kvctl.server.plane.discovery_limits import (
    IDENTITY,
    MAX_ANSWER_BYTES,
    MAX_RECORD_BYTES,
    Refusals,
    TooLarge,
    capped_lines,
    read_capped,
)
from kvctl.server.plane.dynamo_discovery import KEY_TTL_S

CONNECT_TIMEOUT_S = 2.0
CALL_TIMEOUT_S = 10.0
"""The longest one gateway call may take, connect to last byte, on one endpoint: a page of a range is at most
about 11 MiB, a second's work even across a slow link."""
WATCH_RENEW_S = 30.0
"""A watch is started afresh (after a new range) at least this often, and each of its reads waits no longer: a
stream that died silently, or that trickles, costs no more."""
PAGE_KEYS = 128
"""Keys whose values a range asks for at once."""
KEY_PAGE = 1000
"""Keys a keys-only range asks for at once (about 300 bytes each in etcd's JSON)."""


Versions = list[tuple[str, object]]
"""Keys, each with its mod_revision (what a refusal is counted once per)."""
KeyValues = list[tuple[str, dict[str, Any]]]
"""Keys, each with its entry of etcd's answer."""


def page_cap(keys: int) -> int:
    """The most a range answer of `keys` keys may hold: each value in base64, its key and revisions, a header."""
    return keys * (MAX_RECORD_BYTES * 4 // 3 + 1024) + 4096


class EtcdDiscovery:
    """Dynamo's etcd backend: a prefix is a range from it to its successor; this router's own records live under
    one lease of its own, renewed by keep_alive() and revoked by close()."""

    can_register = True

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self.url = "etcd:" + ",".join(endpoints)
        self.refusals = Refusals()
        self.expired = 0  # etcd deletes a dead owner's keys with its lease
        self.follows = "watch"
        self._client: httpx.AsyncClient | None = None  # made in the loop that lists
        self._next = 0  # the endpoint to try first: the last one that answered
        self._lease: str | None = None
        self._owned: dict[str, bytes] = {}

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(CALL_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
                                             headers=IDENTITY)
        return self._client

    async def _call(self, path: str, body: dict[str, Any], cap: int = MAX_ANSWER_BYTES) -> dict[str, Any]:
        """One gateway call, on the first endpoint that answers within CALL_TIMEOUT_S; DiscoveryError naming
        each failure if none does, TooLarge for an answer past `cap`."""
        errors = []
        for n in range(len(self.endpoints)):
            i = (self._next + n) % len(self.endpoints)
            try:
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    request = self.client.build_request("POST", f"{self.endpoints[i]}{path}", json=body)
                    answer = await self.client.send(request, stream=True)
                    try:
                        answer.raise_for_status()
                        found = json.loads(await read_capped(answer, cap))
                    finally:
                        await answer.aclose()
                if not isinstance(found, dict):
                    raise ValueError(f"not an etcd answer: {found!r:.80}")
            except TimeoutError:
                errors.append(f"{self.endpoints[i]}: no whole answer within {CALL_TIMEOUT_S:g} s")
                continue
            except (httpx.HTTPError, ValueError) as exc:
                errors.append(f"{self.endpoints[i]}: {type(exc).__name__}: {exc}")
                continue
            self._next = i
            return found
        raise DiscoveryError("; ".join(errors))

    async def list(self, prefix: str) -> dict[str, bytes]:
        return (await self._range(prefix))[0]

    async def _range(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """The keys under `prefix` and the store's revision they are as of: the keys and their revisions first
        (small), then the values a page of keys at a time, at that revision, leaving out the keys already known
        too large at their revision; a value past MAX_RECORD_BYTES is skipped and counted."""
        keys, revision = await self._keys(prefix)
        found: dict[str, bytes] = {}
        refused = {key for key, version in keys if self.refusals.holds(key, version, "too_large")}
        wanted = [(key, version) for key, version in keys if key not in refused]
        for first in range(0, len(wanted), PAGE_KEYS):
            for key, kv in await self._values(wanted[first:first + PAGE_KEYS], revision, refused):
                if (value := self._value(key, kv, refused)) is not None:
                    found[key] = value
        self.refusals.forget(prefix, refused)
        return found, revision

    async def _keys(self, prefix: str) -> tuple[Versions, int]:
        """Every key under `prefix` with its mod_revision, in order, and the revision they are as of."""
        keys: Versions = []
        span, revision = _span(prefix), 0
        while True:
            body = {**span, "keys_only": True, "limit": KEY_PAGE, **({"revision": revision} if revision else {})}
            answer = await self._call("/v3/kv/range", body, KEY_PAGE * 1024 + 4096)
            revision = revision or int((answer.get("header") or {}).get("revision", 0))
            kvs = _kvs(answer)
            keys += [(key, kv.get("mod_revision")) for kv in kvs if (key := self._key(kv)) is not None]
            if not answer.get("more") or not kvs:
                return keys, revision
            span = {**span, "key": _b64(base64.b64decode(kvs[-1].get("key", "")) + b"\0")}

    async def _values(self, page: Versions, revision: int,
                      refused: set[str]) -> KeyValues:
        """The `page` of keys (with their mod_revision) and their values, as of `revision`; past the page's cap (a
        value too large among them), each key alone, and one still past the cap of one record skipped and counted
        (and left out of later ranges while its revision stays)."""
        first, last = page[0][0], page[-1][0]
        body = {"key": _b64(first.encode()), "range_end": _b64(last.encode() + b"\0"), "revision": revision}
        try:
            answer = await self._call("/v3/kv/range", body, page_cap(len(page)))
        except TooLarge:
            if len(page) == 1:
                refused.add(first)
                self.refusals.refuse(first, page[0][1], "too_large", f"{first}: a value past {MAX_RECORD_BYTES} bytes")
                return []
            return [kv for one in page for kv in await self._values([one], revision, refused)]
        asked = {key for key, _ in page}
        return [(key, kv) for kv in _kvs(answer) if (key := self._key(kv)) is not None and key in asked]

    def _key(self, kv: Any) -> str | None:
        try:
            return base64.b64decode(kv["key"], validate=True).decode()
        except (KeyError, TypeError, ValueError):  # binascii.Error and UnicodeDecodeError are ValueErrors
            self.refusals.refuse(repr(kv)[:80], None, "bad_etcd_key", f"not a base64 key: {repr(kv)[:80]}")
            return None

    def _value(self, key: str, kv: dict[str, Any], refused: set[str]) -> bytes | None:
        """A key's value, or None (counted) when it is too large or not base64."""
        encoded = kv.get("value", "")
        cause = "too_large" if len(encoded) > MAX_RECORD_BYTES * 4 // 3 + 4 else None
        try:
            value = base64.b64decode(encoded, validate=True) if cause is None else b""
        except (TypeError, ValueError):
            cause = "bad_etcd_value"
        if cause is None:
            return value
        refused.add(key)
        self.refusals.refuse(key, kv.get("mod_revision"), cause, f"{key}: a value past {MAX_RECORD_BYTES} bytes "
                             f"({len(encoded)} in base64)" if cause == "too_large" else f"{key}: not base64")
        return None

    async def changes(self, prefix: str, poll_s: float) -> AsyncIterator[dict[str, bytes]]:
        """A range, then etcd's watch from the revision after it: each batch of puts and deletes is one change.
        The watch is started again (after a new range) every WATCH_RENEW_S, and whenever its stream breaks, so a
        connection lost without a word costs at most that long; a watch that ends at once waits `poll_s`."""
        loop = asyncio.get_running_loop()
        while True:
            records, revision = await self._range(prefix)
            yield records
            started = loop.time()
            async for changed in self._watch(prefix, revision + 1, records):
                yield changed
            await asyncio.sleep(max(0.0, started + poll_s - loop.time()))

    async def _watch(self, prefix: str, start: int, records: dict[str, bytes]) -> AsyncIterator[dict[str, bytes]]:
        """The changes after `start` until WATCH_RENEW_S has passed, the stream breaks or a line passes its cap
        (the range after it skips and counts the value too large). No yield inside a deadline: the caller's
        work between changes must not be what the deadline cancels."""
        body = {"create_request": {**_span(prefix), "start_revision": str(start)}}
        deadline = asyncio.get_running_loop().time() + WATCH_RENEW_S
        answer: httpx.Response | None = None
        try:
            async with asyncio.timeout_at(deadline):
                request = self.client.build_request("POST", f"{self.endpoints[self._next]}/v3/watch", json=body)
                answer = await self.client.send(request, stream=True)
                answer.raise_for_status()
            lines = capped_lines(answer, page_cap(PAGE_KEYS))
            while True:
                async with asyncio.timeout_at(deadline):
                    line = await anext(lines, None)
                if line is None:
                    return
                result = _result(json.loads(line))
                if result.get("canceled") or result.get("compact_revision"):
                    return  # compacted past our revision, or refused: range again
                events = result.get("events")
                if isinstance(events, list) and self._changed(events, records):
                    yield records
        except (httpx.HTTPError, ValueError, TimeoutError, TooLarge):
            return  # renewed, broken, or a change too large: range again (a store that is gone raises there)
        finally:
            if answer is not None:
                await answer.aclose()

    def _changed(self, events: Sequence[Any], records: dict[str, bytes]) -> bool:
        """Apply a watch answer's puts and deletes to `records`; whether it held any."""
        for event in events:
            if not isinstance(event, dict):
                continue
            kv = event.get("kv") or {}
            key = self._key(kv)
            if key is None:
                continue
            value = None if event.get("type") == "DELETE" else self._value(key, kv, set())
            if value is None:  # deleted, or replaced by a value refused: the record is gone either way
                records.pop(key, None)
            else:
                records[key] = value
        return bool(events)

    async def register(self, key: str, value: bytes) -> None:
        self._owned[key] = value
        if self._lease is None:
            await self._grant()
        else:
            await self._put(key, value)

    async def _grant(self) -> None:
        """A new lease, and every record of this router filed under it (after an old lease ran out too)."""
        answer = await self._call("/v3/lease/grant", {"TTL": int(KEY_TTL_S)})
        if not answer.get("ID"):
            raise DiscoveryError(f"{self.url}: no lease granted: {answer.get('error') or answer}")
        self._lease = str(answer["ID"])
        for key, value in self._owned.items():
            await self._put(key, value)

    async def _put(self, key: str, value: bytes) -> None:
        await self._call("/v3/kv/put", {"key": _b64(key.encode()), "value": _b64(value), "lease": self._lease})

    async def keep_alive(self) -> None:
        if self._lease is None:
            if self._owned:
                await self._grant()
            return
        answer = await self._call("/v3/lease/keepalive", {"ID": self._lease})
        if int((answer.get("result") or {}).get("TTL") or 0) <= 0:  # it ran out: its keys are gone
            await self._grant()

    async def close(self) -> None:
        if self._lease is not None:
            with contextlib.suppress(DiscoveryError, TooLarge):  # unrevoked, the keys go with the lease's TTL
                await self._call("/v3/lease/revoke", {"ID": self._lease})
            self._lease = None
        self._owned = {}
        if self._client is not None:
            await self._client.aclose()


def _result(message: Any) -> dict[str, Any]:
    """A watch line's `result` ({} for a line of another shape)."""
    result = message.get("result") if isinstance(message, dict) else None
    return result if isinstance(result, dict) else {}


def _kvs(answer: dict[str, Any]) -> list[Any]:
    kvs = answer.get("kvs", [])
    if not isinstance(kvs, list):
        raise DiscoveryError("not an etcd range response")
    return kvs


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _span(prefix: str) -> dict[str, str]:
    """etcd's JSON for every key under `prefix`."""
    return {"key": _b64(prefix.encode()), "range_end": _b64(_successor(prefix.encode()))}


def _successor(prefix: bytes) -> bytes:
    """etcd's range end for a prefix: the prefix with its last byte below 0xff incremented, the rest dropped."""
    trimmed = prefix.rstrip(b"\xff")
    return trimmed[:-1] + bytes([trimmed[-1] + 1]) if trimmed else b"\0"
