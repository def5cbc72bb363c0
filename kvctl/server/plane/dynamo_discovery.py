"""Dynamo's discovery store (docs/contract.md): `--dynamo-discovery file:DIR` or `etcd:URL[,URL...]` (and
`kubernetes[:NAMESPACE]`, read only: kube_discovery.py).

A store answers one question, polled: every key under a prefix, with its value. It also keeps this router's
own records (its replica-sync channels) alive for as long as it runs, as Dynamo's processes keep theirs.
Dynamo's file backend (`DYN_FILE_KV`) keeps a key as the file `DIR/{bucket}/{rest, percent-encoded}`, written
as a `.tmp_` file then renamed; owners touch their files every few seconds, a file untouched for KEY_TTL_S is
dead (Dynamo's processes delete it; this reader ignores it) and a clean stop deletes them. Files are re-read
only when their mtime or size changed, so a poll of a quiet fleet is a directory listing. Names that are not
the encoding of a key (a stray file) are counted, not fatal. etcd holds the same keys (no leading slash) and
values, bound to their owner's lease; they are read with one range request through etcd's JSON gateway
(`/v3/kv/range`, v3.4 and later), trying each URL in turn, and written under a lease of this router's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

import httpx

from kvctl.core.events.discovery import CHANNELS_BUCKET, decode_file_name, encode_file_name
from kvctl.core.events.errors import DecodeError
from kvctl.errors import DiscoveryError

KEY_TTL_S = 10.0
"""Dynamo's: a record whose owner has not refreshed it (touched the file, renewed the lease) for this long is
gone."""
KEEP_ALIVE_S = KEY_TTL_S / 3
"""How often this router refreshes its own records (Dynamo refreshes at a third of the TTL)."""
TEMP_PREFIX = ".tmp_"
"""Dynamo's file backend's half-written records: never read, never counted."""


class Discovery(Protocol):
    url: str
    can_register: bool  # whether register() can file this router's records (Kubernetes discovery cannot)
    stray: Counter[str]  # entries that are not records, by why

    @property
    def expired(self) -> int:
        """Records the last listing ignored: their owners stopped refreshing them."""
        ...

    follows: str  # how changes are seen: "watch" or "poll"

    async def list(self, prefix: str) -> dict[str, bytes]:
        """Every live key under `prefix` (no leading slash) and its value."""
        ...

    def changes(self, prefix: str, poll_s: float) -> AsyncIterator[dict[str, bytes]]:
        """The records under `prefix`: all of them first, then again whenever they may have changed (a watch
        where the store has one, else each `poll_s`). Raises DiscoveryError when the store is lost."""
        ...

    async def register(self, key: str, value: bytes) -> None:
        """File this router's own record; it lives until close() (refreshed by keep_alive())."""
        ...

    async def keep_alive(self) -> None:
        """Refresh this router's records (call every KEEP_ALIVE_S); a record lost meanwhile is filed again."""
        ...

    async def close(self) -> None:
        """Delete this router's records and let go of the store."""
        ...


async def polled(store: Discovery, prefix: str, poll_s: float) -> AsyncIterator[dict[str, bytes]]:
    """A store's changes where it has no watch: a listing every `poll_s` (a quiet poll is cheap)."""
    while True:
        yield await store.list(prefix)
        await asyncio.sleep(poll_s)


class FileDiscovery:
    """Dynamo's file backend: a directory per bucket, a file per key. Polled: a file's mtime, which says
    whether its owner lives, changes without an event a watch would see."""

    can_register = True

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file:{root}"
        self.stray: Counter[str] = Counter()
        self.follows = "poll"
        self._expired: Counter[str] = Counter()  # by bucket, in its last listing
        self._cache: dict[str, tuple[int, int, bytes]] = {}  # bucket/file name -> (mtime_ns, size, contents)
        self._owned: dict[Path, bytes] = {}  # this router's records: path -> value

    @property
    def expired(self) -> int:
        """Event-channel records the last listing ignored: their owners stopped touching them."""
        return self._expired[CHANNELS_BUCKET]

    async def list(self, prefix: str) -> dict[str, bytes]:
        return await asyncio.to_thread(self._list, prefix)

    def changes(self, prefix: str, poll_s: float) -> AsyncIterator[dict[str, bytes]]:
        return polled(self, prefix, poll_s)

    def _list(self, prefix: str) -> dict[str, bytes]:
        bucket = "/".join(prefix.split("/")[:2])  # v1/event_channels, v1/event_sources: a directory each
        if not bucket.startswith("v1/") or not prefix.startswith(bucket + "/"):
            raise ValueError(f"only a bucket's keys (v1/BUCKET/...) are listed, not {prefix!r}")
        directory = self.root / bucket
        if not self.root.is_dir():
            raise DiscoveryError(f"{self.root} is not a directory")
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            return {}  # nothing registered yet: Dynamo makes the bucket with its first record
        except OSError as exc:
            raise DiscoveryError(f"cannot list {directory}: {exc.strerror}") from None
        found: dict[str, bytes] = {}
        cache = {name: cached for name, cached in self._cache.items() if not name.startswith(bucket + "/")}
        self._expired[bucket] = 0
        for entry in entries:
            if entry.name.startswith(TEMP_PREFIX):
                continue
            try:
                key = f"{bucket}/{decode_file_name(entry.name)}"
            except DecodeError:
                self.stray["bad_file_name"] += 1
                continue
            if not key.startswith(prefix):
                continue
            contents = self._read(f"{bucket}/{entry.name}", entry)
            if contents is not None:
                found[key] = contents
                cache[f"{bucket}/{entry.name}"] = self._cache[f"{bucket}/{entry.name}"]
        self._cache = cache
        return found

    def _read(self, name: str, entry: os.DirEntry[str]) -> bytes | None:
        """The file's contents (`name`: bucket/file), from the cache while its mtime and size stay; None when it
        went meanwhile or its owner stopped touching it."""
        try:
            st = entry.stat()
            if st.st_mtime < time.time() - KEY_TTL_S:
                self._expired[name.rsplit("/", 1)[0]] += 1
                return None
            cached = self._cache.get(name)
            if cached is not None and cached[:2] == (st.st_mtime_ns, st.st_size):
                return cached[2]
            with open(entry.path, "rb") as f:
                contents = f.read()
        except FileNotFoundError:
            return None
        except OSError:
            self.stray["unreadable"] += 1
            return None
        self._cache[name] = (st.st_mtime_ns, st.st_size, contents)
        return contents

    async def register(self, key: str, value: bytes) -> None:
        if not key.startswith(CHANNELS_BUCKET + "/"):
            raise ValueError(f"only {CHANNELS_BUCKET}/ records are filed, not {key!r}")
        path = self.root / CHANNELS_BUCKET / encode_file_name(key.removeprefix(CHANNELS_BUCKET + "/"))
        self._owned[path] = value
        await asyncio.to_thread(self._write, path, value)

    @staticmethod
    def _write(path: Path, value: bytes) -> None:
        """Whole or not at all, as Dynamo writes: a temporary its readers skip, renamed into place."""
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.parent / f"{TEMP_PREFIX}{secrets.token_hex(8)}"
        temp.write_bytes(value)
        os.replace(temp, path)

    async def keep_alive(self) -> None:
        await asyncio.to_thread(self._touch)

    def _touch(self) -> None:
        for path, value in self._owned.items():
            try:
                os.utime(path)
            except FileNotFoundError:  # deleted as expired while this process was stalled: file it again
                self._write(path, value)

    async def close(self) -> None:
        owned, self._owned = self._owned, {}
        for path in owned:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


ETCD_TIMEOUT_S = 2.0
WATCH_RENEW_S = 30.0
"""A watch is started afresh (after a new range) at least this often: a stream that died silently costs no more."""


class EtcdDiscovery:
    """Dynamo's etcd backend, through etcd's JSON gateway: a prefix is a range from it to its successor; this
    router's own records live under one lease of its own, renewed by keep_alive() and revoked by close()."""

    can_register = True

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self.url = "etcd:" + ",".join(endpoints)
        self.stray: Counter[str] = Counter()
        self.expired = 0  # etcd deletes a dead owner's keys with its lease
        self.follows = "watch"
        self._client: httpx.AsyncClient | None = None  # made in the loop that lists
        self._next = 0  # the endpoint to try first: the last one that answered
        self._lease: str | None = None
        self._owned: dict[str, bytes] = {}

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One gateway call, on the first endpoint that answers; DiscoveryError naming each failure if none."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=ETCD_TIMEOUT_S)
        errors = []
        for n in range(len(self.endpoints)):
            i = (self._next + n) % len(self.endpoints)
            try:
                answer = await self._client.post(f"{self.endpoints[i]}{path}", json=body)
                answer.raise_for_status()
                found = answer.json()
                if not isinstance(found, dict):
                    raise ValueError(f"not an etcd answer: {found!r:.80}")
            except (httpx.HTTPError, ValueError) as exc:
                errors.append(f"{self.endpoints[i]}: {type(exc).__name__}: {exc}")
                continue
            self._next = i
            return found
        raise DiscoveryError("; ".join(errors))

    async def list(self, prefix: str) -> dict[str, bytes]:
        return (await self._range(prefix))[0]

    async def _range(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """The keys under `prefix` and the store's revision they are as of."""
        answer = await self._call("/v3/kv/range", _span(prefix))
        if not isinstance(answer.get("kvs", []), list):
            raise DiscoveryError(f"{self.url}: not an etcd range response")
        found: dict[str, bytes] = {}
        for kv in answer.get("kvs", []):
            key = self._key(kv)
            if key is not None:
                found[key] = base64.b64decode(kv.get("value", ""))
        return found, int((answer.get("header") or {}).get("revision", 0))

    def _key(self, kv: Any) -> str | None:
        try:
            return base64.b64decode(kv["key"], validate=True).decode()
        except (KeyError, TypeError, ValueError):  # binascii.Error and UnicodeDecodeError are ValueErrors
            self.stray["bad_etcd_key"] += 1
            return None

    async def changes(self, prefix: str, poll_s: float) -> AsyncIterator[dict[str, bytes]]:
        """A range, then etcd's watch from the revision after it: each batch of puts and deletes is one change.
        The watch is started again (after a new range) every WATCH_RENEW_S, and whenever its stream breaks, so a
        connection lost without a word costs at most that long."""
        while True:
            records, revision = await self._range(prefix)
            yield records
            async for changed in self._watch(prefix, revision + 1, records):
                yield changed

    async def _watch(self, prefix: str, start: int, records: dict[str, bytes]) -> AsyncIterator[dict[str, bytes]]:
        body = {"create_request": {**_span(prefix), "start_revision": str(start)}}
        url = self.endpoints[self._next]
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=ETCD_TIMEOUT_S)
        deadline = time.monotonic() + WATCH_RENEW_S
        try:
            async with self._client.stream("POST", f"{url}/v3/watch", json=body,
                                           timeout=httpx.Timeout(ETCD_TIMEOUT_S, read=WATCH_RENEW_S)) as answer:
                answer.raise_for_status()
                async for line in answer.aiter_lines():
                    result = json.loads(line).get("result") or {}
                    if result.get("canceled") or result.get("compact_revision"):
                        return  # compacted past our revision, or refused: range again
                    events = result.get("events") or []
                    for event in events:
                        key = self._key(event.get("kv") or {})
                        if key is None:
                            continue
                        if event.get("type") == "DELETE":  # PUT, the default, is left out of the JSON
                            records.pop(key, None)
                        else:
                            records[key] = base64.b64decode(event["kv"].get("value", ""))
                    if events:
                        yield records
                    if time.monotonic() > deadline:
                        return
        except (httpx.HTTPError, ValueError):
            return  # a broken watch: range again (a store that is gone raises there)
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
            with contextlib.suppress(DiscoveryError):  # unrevoked, the keys go with the lease's TTL
                await self._call("/v3/lease/revoke", {"ID": self._lease})
            self._lease = None
        self._owned = {}
        if self._client is not None:
            await self._client.aclose()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _span(prefix: str) -> dict[str, str]:
    """etcd's JSON for every key under `prefix`."""
    return {"key": _b64(prefix.encode()), "range_end": _b64(_successor(prefix.encode()))}


def _successor(prefix: bytes) -> bytes:
    """etcd's range end for a prefix: the prefix with its last byte below 0xff incremented, the rest dropped."""
    trimmed = prefix.rstrip(b"\xff")
    return trimmed[:-1] + bytes([trimmed[-1] + 1]) if trimmed else b"\0"


def open_discovery(url: str) -> Discovery:
    """The store a `--dynamo-discovery` value names; ValueError (a usage error) for anything else, and
    DiscoveryError where Kubernetes discovery finds no API server to ask."""
    scheme, sep, where = url.partition(":")
    if scheme == "kubernetes":
        from kvctl.server.plane.kube_discovery import KubernetesDiscovery, parse_kubernetes_url

        return KubernetesDiscovery(parse_kubernetes_url(where))
    if scheme == "file" and sep and where:
        return FileDiscovery(Path(where))
    if scheme == "etcd" and sep and where:
        endpoints = [e.strip().rstrip("/") for e in where.split(",")]
        if all(e.startswith(("http://", "https://")) and len(e) > len("https://") for e in endpoints):
            return EtcdDiscovery(endpoints)
    raise ValueError(f"--dynamo-discovery wants file:DIR, etcd:http://HOST:2379[,...] or kubernetes[:NAMESPACE], "
                     f"got {url!r}")
