"""What a discovery store may cost the router (issue 36): a record's size, an answer's size, a call's time, and
what a skipped entry becomes (a count by cause in the plane's status, a loss in the health ledger).

A store is written by the fleet, by hand, or by whatever else can write there, so each entry is judged before it
is read: a file store's entry must be a regular file (never a symlink, never a FIFO, which would block the
reader, nor a device), no larger than MAX_RECORD_BYTES; an etcd or Kubernetes answer is read up to a cap and
within a deadline. An entry refused is counted once per version of it (a file's inode and size, an etcd key's
revision), not once per poll.
"""

from __future__ import annotations

import errno
import os
import stat
from collections import Counter
from collections.abc import AsyncIterator, Callable

import httpx

MAX_RECORD_BYTES = 64 * 1024
"""A Dynamo record is well under a few KB (an event channel's is about 500 bytes): 64 KiB leaves a hundredfold
headroom and bounds what one hostile record (a symlink to /dev/zero, a 300 MB file) can cost."""
MAX_ANSWER_BYTES = 64 * 1024
"""A store's answer that carries no records (a lease granted, a put acknowledged)."""
IDENTITY = {"accept-encoding": "identity"}
"""Asked of every store: a compressed answer could expand past a cap within one chunk."""

LoseHook = Callable[[str, str, str], None]
"""(cause, detail, fix): where a store reports an entry it refused; the plane hands it to the health ledger."""

FIXES = {
    "symlink": "remove it: Dynamo's file backend writes each record as a regular file, and a link may lead "
               "anywhere (/dev/zero)",
    "not_a_file": "remove it: a FIFO, socket, device or directory is no record (a FIFO would block the reader)",
    "too_large": f"remove or rewrite the record: a Dynamo record is a few hundred bytes, past "
                 f"{MAX_RECORD_BYTES // 1024} KiB it is refused",
    "unreadable": "check the file's permissions: kvctl serve must be able to read every record",
    "bad_file_name": "remove the file: the store's files are named by their key, percent-encoded",
    "bad_etcd_key": "the key is not base64 in etcd's answer: check what fronts etcd (a proxy) and its version",
    "bad_etcd_value": "the value is not base64 in etcd's answer: check what fronts etcd (a proxy) and its version",
    "bad_document": "fix the DynamoWorkerMetadata resource: its spec.data is not Dynamo's layout",
    "bad_channel_key": "the DynamoWorkerMetadata's event_channels use another layout than Dynamo 1.6.1's",
    "bad_card_key": "the DynamoWorkerMetadata's model_cards use another layout than Dynamo 1.6.1's",
    "wildcard_address": "the publisher advertised its bind address: set DYN_EVENT_PLANE_HOST (or its "
                        "--advertise-host) to an address subscribers reach it at",
    "unroutable_address": "the record's address (port 0 or past 65535, multicast, broadcast) reaches no "
                          "publisher: fix what wrote it",
    "own_address": "the record names this router's own HTTP listen address: fix what wrote it (an "
                   "--advertise-host or port copied from the router?)",
    "too_many_channels": "raise --max-channels (and ulimit -n), narrow the plane (--namespace, --component, "
                         "--endpoint), or remove stale records",
    "connect_failed": "ZMQ refused the address or ran out of descriptors: see the detail; raise ulimit -n or "
                      "lower --max-channels",
}


def _nowhere(cause: str, detail: str, fix: str) -> None:
    """A store's refusals where nobody keeps a ledger (`kvctl events tail`): counted in `counts` only."""


class Refusals:
    """Entries a store skipped: `counts` by cause (the plane's `discovery.stray`), each handed once per version
    of the entry to `lose` (the plane sets it to the health ledger)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.lose: LoseHook = _nowhere
        self._counted: dict[str, tuple[object, str]] = {}  # entry -> (its version, cause) when last counted

    def refuse(self, entry: str, version: object, cause: str, detail: str) -> None:
        if self._counted.get(entry) == (version, cause):
            return
        self._counted[entry] = (version, cause)
        self.counts[cause] += 1
        self.lose(cause, detail, FIXES.get(cause, ""))

    def holds(self, entry: str, version: object, cause: str) -> bool:
        """Whether `entry` was refused for `cause` at `version` (its store need not be asked for it again)."""
        return self._counted.get(entry) == (version, cause)

    def forget(self, under: str, still: set[str]) -> None:
        """Forget the entries under `under` not refused again in its last listing: one that comes back counts."""
        self._counted = {e: v for e, v in self._counted.items() if not e.startswith(under) or e in still}


class Refused(Exception):
    """An entry a store will not read: `cause` is the loss's label, the message its detail."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause


class TooLarge(Exception):
    """An answer past its cap (read up to the cap, then dropped)."""


def judge_entry(st: os.stat_result) -> str | None:
    """Why a file store's entry (its lstat) is not read: before it is opened, so that a FIFO cannot block and a
    device is never opened; None for a regular file within MAX_RECORD_BYTES."""
    if stat.S_ISLNK(st.st_mode):
        return "symlink"
    if not stat.S_ISREG(st.st_mode):
        return "not_a_file"
    if st.st_size > MAX_RECORD_BYTES:
        return "too_large"
    return None


def read_record(dir_fd: int, name: str) -> bytes:
    """The file `name` of the directory `dir_fd`, never through a symlink, never waiting on a FIFO (swapped in
    since its lstat), at most MAX_RECORD_BYTES (it may have grown since); Refused otherwise."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink swapped in since the lstat
            raise Refused("symlink", f"{name} became a symlink while it was read") from None
        raise
    try:
        why = judge_entry(os.fstat(fd))
        if why is not None:
            raise Refused(why, f"{name} became a {why.replace('_', ' ')} while it was read")
        chunks, size = [], 0
        while size <= MAX_RECORD_BYTES and (chunk := os.read(fd, MAX_RECORD_BYTES + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_RECORD_BYTES:
            raise Refused("too_large", f"{name} grew past {MAX_RECORD_BYTES} bytes while it was read")
        return b"".join(chunks)
    finally:
        os.close(fd)


async def read_capped(response: httpx.Response, cap: int) -> bytes:
    """A streamed answer's body, or TooLarge once it passes `cap` bytes (read no further)."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise TooLarge(f"{declared} bytes")
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > cap:
            raise TooLarge(f"over {cap} bytes")
    return bytes(body)


async def capped_lines(response: httpx.Response, cap: int) -> AsyncIterator[bytes]:
    """A streamed answer's lines (etcd's watch), or TooLarge when one passes `cap` bytes."""
    pending = bytearray()
    async for chunk in response.aiter_raw():
        pending += chunk
        while (end := pending.find(b"\n")) >= 0:
            yield bytes(pending[:end])
            del pending[:end + 1]
        if len(pending) > cap:
            raise TooLarge(f"a line over {cap} bytes")
    if pending:
        yield bytes(pending)
