"""Reading Dynamo's discovery store (DESIGN §3.2): `--dynamo-discovery file:DIR` or `etcd:URL[,URL...]`.

A store answers one question, polled: every key under a prefix, with its value. Dynamo's file backend
(`DYN_FILE_KV`) keeps a key as the file `DIR/{bucket}/{rest, percent-encoded}`; owners refresh the mtimes and
a clean stop deletes the files. Files are re-read only when their mtime or size changed, so a poll of a quiet
fleet is a directory listing. Names that are not the encoding of a key (a stray file) are counted, not fatal.
etcd holds the same keys (no leading slash) and values, bound to their owner's lease; they are read with one
range request through etcd's JSON gateway (`/v3/kv/range`, v3.4 and later), trying each URL in turn.
"""

from __future__ import annotations

import asyncio
import base64
import os
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

import httpx

from kvctl.core.events.discovery import decode_file_name
from kvctl.core.events.errors import DecodeError


class DiscoveryError(Exception):
    """The store cannot be read now (gone, unreachable, refused); the next poll tries again."""


class Discovery(Protocol):
    url: str
    stray: Counter[str]  # entries that are not records, by why

    async def list(self, prefix: str) -> dict[str, bytes]:
        """Every key under `prefix` (no leading slash) and its value."""
        ...

    async def close(self) -> None: ...


class FileDiscovery:
    """Dynamo's file backend: a directory per bucket, a file per key."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file:{root}"
        self.stray: Counter[str] = Counter()
        self._cache: dict[str, tuple[int, int, bytes]] = {}  # bucket/file name -> (mtime_ns, size, contents)

    async def list(self, prefix: str) -> dict[str, bytes]:
        return await asyncio.to_thread(self._list, prefix)

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
        for entry in entries:
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
        """The file's contents, from the cache while its mtime and size stay; None when it went meanwhile."""
        try:
            st = entry.stat()
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

    async def close(self) -> None:
        pass


ETCD_TIMEOUT_S = 2.0


class EtcdDiscovery:
    """Dynamo's etcd backend, through etcd's JSON gateway: a prefix is a range from it to its successor."""

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self.url = "etcd:" + ",".join(endpoints)
        self.stray: Counter[str] = Counter()
        self._client: httpx.AsyncClient | None = None  # made in the loop that lists
        self._next = 0  # the endpoint to try first: the last one that answered

    async def list(self, prefix: str) -> dict[str, bytes]:
        body = {"key": _b64(prefix.encode()), "range_end": _b64(_successor(prefix.encode()))}
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=ETCD_TIMEOUT_S)
        errors = []
        for n in range(len(self.endpoints)):
            i = (self._next + n) % len(self.endpoints)
            try:
                answer = await self._client.post(f"{self.endpoints[i]}/v3/kv/range", json=body)
                answer.raise_for_status()
                found = self._records(answer.json())
            except (httpx.HTTPError, ValueError) as exc:
                errors.append(f"{self.endpoints[i]}: {type(exc).__name__}: {exc}")
                continue
            self._next = i
            return found
        raise DiscoveryError("; ".join(errors))

    def _records(self, answer: Any) -> dict[str, bytes]:
        if not isinstance(answer, dict) or not isinstance(answer.get("kvs", []), list):
            raise ValueError("not an etcd range response")
        found: dict[str, bytes] = {}
        for kv in answer.get("kvs", []):
            try:
                found[base64.b64decode(kv["key"], validate=True).decode()] = base64.b64decode(kv.get("value", ""))
            except (KeyError, TypeError, ValueError):  # binascii.Error and UnicodeDecodeError are ValueErrors
                self.stray["bad_etcd_key"] += 1
        return found

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _successor(prefix: bytes) -> bytes:
    """etcd's range end for a prefix: the prefix with its last byte below 0xff incremented, the rest dropped."""
    trimmed = prefix.rstrip(b"\xff")
    return trimmed[:-1] + bytes([trimmed[-1] + 1]) if trimmed else b"\0"


def open_discovery(url: str) -> Discovery:
    """The store a `--dynamo-discovery` value names; ValueError (a usage error) for anything else."""
    scheme, sep, where = url.partition(":")
    if scheme == "file" and sep and where:
        return FileDiscovery(Path(where))
    if scheme == "etcd" and sep and where:
        endpoints = [e.strip().rstrip("/") for e in where.split(",")]
        if all(e.startswith(("http://", "https://")) and len(e) > len("https://") for e in endpoints):
            return EtcdDiscovery(endpoints)
    raise ValueError(f"--dynamo-discovery wants file:DIR or etcd:http://HOST:2379[,...], got {url!r}")
