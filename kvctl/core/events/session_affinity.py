"""Dynamo 1.6.1's `session_affinity_events`: a frontend with `--router-session-affinity-ttl-secs` publishes, on
each worker set's channel (backend, prefill), the worker each session is pinned to. Seen on a live 1.6.1 fleet
(tests/interop/test_session_affinity.py): a msgpack map `{session_id, worker_id, dp_rank, sequence, writer_id}`
in the plane's usual envelope, sent twice per request; `sequence` is the binding's version, `writer_id` the
router that made it."""

from __future__ import annotations

from dataclasses import dataclass

from kvctl.core.events.errors import DecodeError, ErrorKind, as_map, as_uint, describe, parse_msgpack, require
from kvctl.core.names import WorkerKey

SESSION_AFFINITY = "session_affinity_events"
MAX_SESSION_ID_BYTES = 1024
"""A session id longer than this is refused: Dynamo's come from a request header (`x-dynamo-session-id`)."""

_U32_MAX = (1 << 32) - 1


@dataclass(frozen=True, slots=True)
class SessionBinding:
    session_id: str
    worker: WorkerKey
    sequence: int
    writer_id: int


def decode_session_binding(data: bytes) -> SessionBinding:
    obj = as_map(parse_msgpack(data), "SessionAffinity")
    session_id = require(obj, "session_id")
    if not isinstance(session_id, str) or not session_id or len(session_id.encode()) > MAX_SESSION_ID_BYTES:
        raise DecodeError(ErrorKind.bad_type, "session_id", f"expected a string of 1 to {MAX_SESSION_ID_BYTES} "
                                                            f"bytes, got {describe(session_id)}")
    return SessionBinding(session_id, (as_uint(require(obj, "worker_id"), "worker_id"),
                                       as_uint(obj.get("dp_rank", 0), "dp_rank", _U32_MAX)),
                          as_uint(require(obj, "sequence"), "sequence"),
                          as_uint(require(obj, "writer_id"), "writer_id"))
