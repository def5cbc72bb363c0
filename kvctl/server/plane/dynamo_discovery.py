"""Dynamo's discovery store (docs/contract.md): `--dynamo-discovery file:DIR` or `etcd:URL[,URL...]` (and
`kubernetes[:NAMESPACE]`, read only: kube_discovery.py).

A store answers one question, polled: every key under a prefix, with its value. It also keeps this router's
own records (its replica-sync channels) alive for as long as it runs, as Dynamo's processes keep theirs.
Dynamo's file backend (`DYN_FILE_KV`) keeps a key as the file `DIR/{bucket}/{rest, percent-encoded}`, written
as a `.tmp_` file then renamed; owners touch their files every few seconds, a file untouched for KEY_TTL_S is
dead (Dynamo's processes delete it; this reader ignores it) and a clean stop deletes them. Files are re-read
only when their inode, mtime or size changed, so a poll of a quiet fleet is a directory listing and a touch
costs one read of a small file. Only regular files within MAX_RECORD_BYTES are read, never through a symlink,
and a FIFO is never opened (discovery_limits.py); whatever else is there (a stray name, a symlink, a FIFO, a
300 MB file) is skipped and counted, never fatal. etcd (etcd_discovery.py) holds the same keys and values.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import stat
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Protocol

from kvctl.core.events.discovery import CHANNELS_BUCKET, decode_file_name, encode_file_name
from kvctl.core.events.errors import DecodeError
from kvctl.errors import DiscoveryError
from kvctl.server.plane.discovery_limits import MAX_RECORD_BYTES, Refusals, Refused, judge_entry, read_record

KEY_TTL_S = 10.0
"""Dynamo's: a record whose owner has not refreshed it (touched the file, renewed the lease) for this long is
gone."""
KEEP_ALIVE_S = KEY_TTL_S / 3
"""How often this router refreshes its own records (Dynamo refreshes at a third of the TTL)."""
RefusedEntries = list[tuple[str, object, str, str]]
"""A file listing's entries refused: (entry, its version, cause, detail), counted on the loop."""
POLL_S = 0.5
"""How often a store without a watch (files) is listed, and the pause before trying a lost store again: a new
publisher is followed within this (Dynamo registers a channel as it binds, before its messages matter)."""
RETRY_MAX_S = 15.0
"""The longest pause between tries of a store that fails (from `poll_s`, doubled at each failure in a row)."""
TEMP_PREFIX = ".tmp_"
"""Dynamo's file backend's half-written records: never read, never counted."""


class Discovery(Protocol):
    url: str
    can_register: bool  # whether register() can file this router's records (Kubernetes discovery cannot)
    refusals: Refusals  # entries that are not records, by why (`refusals.counts`), handed to the ledger

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


async def follow(store: Discovery, prefix: str, poll_s: float,
                 listed: Callable[[dict[str, bytes]], Awaitable[None]], failed: Callable[[DiscoveryError], None],
                 ) -> None:
    """The records under `prefix` for ever, each listing handed to `listed`: a store that fails (`failed` is told)
    is tried again after a pause that doubles from `poll_s` up to RETRY_MAX_S, and back to `poll_s` once it
    answers."""
    pause = poll_s
    while True:
        try:
            async for records in store.changes(prefix, poll_s):
                await listed(records)
                pause = poll_s
        except DiscoveryError as exc:
            failed(exc)
        await asyncio.sleep(pause)
        pause = min(pause * 2, RETRY_MAX_S)


class FileDiscovery:
    """Dynamo's file backend: a directory per bucket, a file per key. Polled: a file's mtime, which says
    whether its owner lives, changes without an event a watch would see."""

    can_register = True

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file:{root}"
        self.refusals = Refusals()
        self.follows = "poll"
        self._expired: Counter[str] = Counter()  # by bucket, in its last listing
        self._cache: dict[str, tuple[tuple[int, int, int], bytes]] = {}  # bucket/file -> ((ino, mtime, size), data)
        self._owned: dict[Path, bytes] = {}  # this router's records: path -> value

    @property
    def expired(self) -> int:
        """Event-channel records the last listing ignored: their owners stopped touching them."""
        return self._expired[CHANNELS_BUCKET]

    async def list(self, prefix: str) -> dict[str, bytes]:
        found, refused = await asyncio.to_thread(self._list, prefix)
        for entry, version, cause, detail in refused:
            self.refusals.refuse(entry, version, cause, detail)
        self.refusals.forget("/".join(prefix.split("/")[:2]) + "/", {entry for entry, *_ in refused})
        return found

    def changes(self, prefix: str, poll_s: float) -> AsyncIterator[dict[str, bytes]]:
        return polled(self, prefix, poll_s)

    def _list(self, prefix: str) -> tuple[dict[str, bytes], RefusedEntries]:
        """The records under `prefix`, and the entries refused (entry, version, cause, detail): counted by the
        caller, on the loop (this runs in a thread)."""
        bucket = "/".join(prefix.split("/")[:2])  # v1/event_channels, v1/event_sources: a directory each
        if not bucket.startswith("v1/") or not prefix.startswith(bucket + "/"):
            raise ValueError(f"only a bucket's keys (v1/BUCKET/...) are listed, not {prefix!r}")
        dir_fd = self._open_bucket(bucket)
        if dir_fd is None:
            return {}, []  # nothing registered yet: Dynamo makes the bucket with its first record
        try:
            with os.scandir(dir_fd) as listing:
                entries = list(listing)
            return self._read_all(bucket, prefix, dir_fd, entries)
        finally:
            os.close(dir_fd)

    def _open_bucket(self, bucket: str) -> int | None:
        """The bucket's directory, opened through no symlink below the store's root; None while it is not there."""
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            raise DiscoveryError(f"{self.root} is not a directory") from None
        try:
            for part in bucket.split("/"):
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = inner
        except FileNotFoundError:
            os.close(fd)
            return None
        except OSError as exc:
            os.close(fd)
            raise DiscoveryError(f"cannot list {self.root / bucket}: {exc.strerror} (a symlink or a file where "
                                 "Dynamo keeps a directory?)") from None
        return fd

    def _read_all(self, bucket: str, prefix: str, dir_fd: int,
                  entries: Sequence[os.DirEntry[str]]) -> tuple[dict[str, bytes], RefusedEntries]:
        found: dict[str, bytes] = {}
        refused: RefusedEntries = []
        cache = {name: cached for name, cached in self._cache.items() if not name.startswith(bucket + "/")}
        self._expired[bucket] = 0
        stale = time.time() - KEY_TTL_S
        for entry in entries:
            name = f"{bucket}/{entry.name}"
            if entry.name.startswith(TEMP_PREFIX):
                continue
            try:
                key = f"{bucket}/{decode_file_name(entry.name)}"
                st = entry.stat(follow_symlinks=False)
            except DecodeError:
                refused.append((name, None, "bad_file_name",
                                f"{self.root / name}: not the percent-encoding of a key"))
                continue
            except FileNotFoundError:
                continue  # gone since the listing
            except OSError as exc:
                refused.append((name, None, "unreadable", f"{self.root / name}: {exc.strerror}"))
                continue
            if not key.startswith(prefix):
                continue
            version = (st.st_ino, st.st_mtime_ns, st.st_size)
            try:
                why = judge_entry(st)
                if why is not None:
                    raise Refused(why, self._describe(bucket, entry.name, why, st, dir_fd))
                if st.st_mtime < stale:
                    self._expired[bucket] += 1
                    continue
                cached = self._cache.get(name)
                contents = cached[1] if cached is not None and cached[0] == version else read_record(
                    dir_fd, entry.name)
            except Refused as exc:
                refused.append((name, (st.st_ino, st.st_size), exc.cause, str(exc)))
                continue
            except FileNotFoundError:
                continue
            except OSError as exc:
                refused.append((name, version, "unreadable", f"{self.root / name}: {exc.strerror}"))
                continue
            found[key] = contents
            cache[name] = (version, contents)
        self._cache = cache
        return found, refused

    def _describe(self, bucket: str, name: str, why: str, st: os.stat_result, dir_fd: int) -> str:
        """A refused entry (`name`, in `bucket`, opened as `dir_fd`) in words: its path, where a symlink leads,
        what a non-file is, how large a record is."""
        path = self.root / bucket / name
        if why == "symlink":
            with contextlib.suppress(OSError):
                return f"{path} is a symlink to {os.readlink(name, dir_fd=dir_fd)}"
            return f"{path} is a symlink"
        if why == "too_large":
            return f"{path} holds {st.st_size} bytes (at most {MAX_RECORD_BYTES} are read)"
        kind = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory",
                stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}.get(stat.S_IFMT(st.st_mode))
        return f"{path} is {kind or 'not a regular file'}"

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
        from kvctl.server.plane.etcd_discovery import EtcdDiscovery

        endpoints = [e.strip().rstrip("/") for e in where.split(",")]
        if all(e.startswith(("http://", "https://")) and len(e) > len("https://") for e in endpoints):
            return EtcdDiscovery(endpoints)
    raise ValueError(f"--dynamo-discovery wants file:DIR, etcd:http://HOST:2379[,...] or kubernetes[:NAMESPACE], "
                     f"got {url!r}")
