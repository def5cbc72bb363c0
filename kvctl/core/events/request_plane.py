"""Dynamo 1.6.1's TCP request plane, as much of it as a KV recovery query needs (docs/contract.md), read from a real
exchange (tests/fixtures/dynamo-1.6.1-fleet/request-plane/). No I/O: the sockets are server/plane/recovery.py's.

A worker that publishes KV events files an `EventSource` record under `v1/event_sources/...` whose
`recovery_target` names an endpoint of its request plane (`transport.tcp`: `HOST:PORT/PATH`). A router asks it
for the worker's index with one request frame on a TCP connection to HOST:PORT:

    u16 BE path length, PATH; u16 BE header length, headers (a JSON map of strings); u32 BE payload length, payload

The payload is a two-part message (u64 BE control length, u64 BE data length, u64 BE checksum, 0; the control
JSON; the data): the control names the request and where to stream the answer (`connection_info`: a TCP
address of the *caller's*), the data is the msgpack `WorkerKvQueryRequest`. The worker acknowledges on the same
connection (u32 BE length, then text: none when it took the request), then connects to the caller's address and
streams two-part messages there: a handshake (control `{"subject", "stream_type"}`), a prologue (control
`{"error": null}`), data messages (msgpack `{"data": WorkerKvQueryResponse, "complete_final": bool}`), and the
control `"sentinel"`.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any

import msgspec

from kvctl.core.events.dynamo import decode_router_events
from kvctl.core.events.errors import (
    DecodeError,
    ErrorKind,
    as_map,
    as_u64,
    describe,
    parse_json,
    parse_msgpack,
    require,
)
from kvctl.core.events.types import RouterEvent
from kvctl.core.names import WorkerKey

SOURCES_BUCKET = "v1/event_sources"
_TCP = re.compile(r"^([^\s/:]+|\[[0-9a-fA-F:]+\]):(\d{1,5})/(\S+)$")
_TWO_PART = struct.Struct(">QQQ")  # control length, data length, checksum
_ACK = struct.Struct(">I")
ACK_HEADER = _ACK.size
"""The worker's acknowledgement of a request: a u32 BE length, then that much text (none: taken)."""
ACK_MAX = 64 << 10
"""The longest acknowledgement taken: its text is a refusal's error message (an HTTP server's `HTTP` reads as a
1.2 GB length)."""
FRAME_MAX = 256 << 20
"""A two-part message longer than this is not one (a tree dump of a large worker is a few MiB)."""
HANDSHAKE_MAX = 4096
"""A response connection's first message (`{"subject", "stream_type"}`: ~75 bytes from Dynamo 1.6.1)."""
SENTINEL = b'"sentinel"'


@dataclass(frozen=True, slots=True)
class RecoveryTarget:
    """Where one worker's index can be asked for: its kv-events publisher and its request-plane endpoint."""

    worker_id: int
    dp_rank: int
    publisher_id: int
    host: str
    port: int
    path: str  # `{instance hex}/{namespace}/{component}/{endpoint}`: the frame's first field
    transport: str = "tcp"  # another (nats): a request plane kvctl does not speak; host, port and path empty

    @property
    def worker(self) -> WorkerKey:
        return (self.worker_id, self.dp_rank)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Recovered:
    """A worker's answer: its events (a tree dump: the whole index, `reset` set; else those from the id asked
    for), and the id of its newest real event, from which live events continue."""

    events: list[RouterEvent]
    errors: list[DecodeError]
    last_event_id: int
    reset: bool


class RecoveryRefused(Exception):
    """The worker answered, but not with events (`TooNew`, `InvalidRange`, `Error`, a failed dump...)."""


def namespace_sources_prefix(namespace: str) -> str:
    return f"{SOURCES_BUCKET}/namespace/{namespace}/"


def parse_event_source(data: bytes | str) -> RecoveryTarget | None:
    """An `EventSource` record; None for a source of another topic than kv-events (it has nothing to recover).
    A record of another shape is a DecodeError."""
    obj = as_map(parse_json(data), "record")
    if require(obj, "type") != "EventSource":
        raise DecodeError(ErrorKind.unknown_type, "type", f"expected EventSource, got {describe(obj['type'])}")
    if obj.get("topic") != "kv-events":
        return None
    meta = as_map(require(obj, "metadata"), "metadata")
    worker = as_map(require(meta, "worker", "metadata.worker"), "metadata.worker")
    target = as_map(require(meta, "recovery_target", "metadata.recovery_target"), "metadata.recovery_target")
    codec = target.get("request_plane_codec", "msgpack")
    if codec != "msgpack":
        raise DecodeError(ErrorKind.unknown_type, "metadata.recovery_target.request_plane_codec",
                          f"expected msgpack, got {describe(codec)}")
    transport = as_map(require(target, "transport", "metadata.recovery_target.transport"),
                     "metadata.recovery_target.transport")
    ids = (as_u64(require(worker, "worker_id"), "metadata.worker.worker_id"),
           as_u64(worker.get("dp_rank", 0), "metadata.worker.dp_rank"),
           as_u64(require(obj, "publisher_id"), "publisher_id"))
    if len(transport) == 1 and "tcp" not in transport:
        return RecoveryTarget(*ids, host="", port=0, path="", transport=str(next(iter(transport))))
    tcp = transport.get("tcp")
    match = _TCP.match(tcp) if isinstance(tcp, str) else None
    if match is None:
        raise DecodeError(ErrorKind.unknown_type, "metadata.recovery_target.transport",
                          f"expected {{\"tcp\": \"HOST:PORT/PATH\"}}, got {describe(transport)}")
    host, port, path = match.groups()
    return RecoveryTarget(*ids, host=host.strip("[]"), port=int(port), path=path)


# ----- the request ------------------------------------------------------------------------------------------

def encode_recovery_request(target: RecoveryTarget, request_id: str, subject: str, reply_address: str,
                            start_event_id: int | None = None, end_event_id: int | None = None) -> bytes:
    """The request frame asking `target` for its worker's events from `start_event_id` (None: a tree dump of
    its whole index), the answer to be streamed to `reply_address` (HOST:PORT) under `subject`."""
    info = {"address": reply_address, "subject": subject, "context": request_id, "stream_type": "response"}
    control = {"id": request_id, "request_type": "single_in", "response_type": "many_out", "payload_codec": "msgpack",
               "connection_info": {"transport": "tcp_server", "info": json.dumps(info, separators=(",", ":"))}}
    query = {"worker_id": target.worker_id, "dp_rank": target.dp_rank, "start_event_id": start_event_id,
             "end_event_id": end_event_id, "supports_tree_dump_failed": True, "kind": "recovery"}
    payload = encode_two_part(json.dumps(control, separators=(",", ":")).encode(), msgspec.msgpack.encode(query))
    headers = json.dumps({"request-id": request_id, "x-endpoint-path": target.path}, separators=(",", ":")).encode()
    path = target.path.encode()
    return (struct.pack(">H", len(path)) + path + struct.pack(">H", len(headers)) + headers
            + struct.pack(">I", len(payload)) + payload)


@dataclass(frozen=True, slots=True)
class RequestFrame:
    """A request frame read back: what a router sent (tests hold kvctl's against Dynamo's own)."""

    path: str
    headers: dict[str, str]
    control: dict[str, Any]
    reply: dict[str, Any]  # the control's connection_info.info, itself JSON
    query: dict[str, Any]


def decode_request_frame(frame: bytes) -> RequestFrame:
    """A whole request frame; a frame of another shape is a DecodeError."""
    try:
        (path_len,) = struct.unpack_from(">H", frame)
        path = frame[2:2 + path_len].decode()
        at = 2 + path_len
        (headers_len,) = struct.unpack_from(">H", frame, at)
        headers = parse_json(frame[at + 2:at + 2 + headers_len])
        at += 2 + headers_len
        (payload_len,) = struct.unpack_from(">I", frame, at)
        payload = frame[at + 4:]
        if len(payload) != payload_len:
            raise DecodeError(ErrorKind.bad_batch, "request",
                              f"{payload_len} payload bytes announced, {len(payload)} sent")
        ((control, data),) = TwoPartReader().feed(payload)
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise DecodeError(ErrorKind.bad_batch, "request", str(exc)) from None
    control_obj = as_map(parse_json(control), "control")
    info = require(as_map(require(control_obj, "connection_info"), "connection_info"), "info", "connection_info.info")
    return RequestFrame(path, as_map(headers, "headers"), control_obj, as_map(parse_json(info), "connection_info.info"),
                        as_map(parse_msgpack(data), "query"))


def encode_two_part(control: bytes, data: bytes) -> bytes:
    return _TWO_PART.pack(len(control), len(data), 0) + control + data


def ack_length(header: bytes) -> int:
    """The length of the acknowledgement's text, from its 4-byte header; past ACK_MAX it is a DecodeError (the
    target speaks something else: an HTTP server answers `HTTP/1.1 400`)."""
    length = int(_ACK.unpack(header)[0])
    if length > ACK_MAX:
        what = "an HTTP server answered (a router's HTTP port?)" if header == b"HTTP" else \
            f"{length} bytes announced, more than {ACK_MAX}"
        raise DecodeError(ErrorKind.bad_batch, "acknowledgement", f"not Dynamo's request plane: {what}")
    return length


# ----- the answer -------------------------------------------------------------------------------------------

class TooLarge(DecodeError):
    """A two-part message announced longer than its reader's limit."""


class TwoPartReader:
    """Two-part messages out of a byte stream, as the bytes arrive."""

    def __init__(self, limit: int = FRAME_MAX) -> None:
        """`limit`: the longest message taken (a response connection's handshake is short: it is read with
        HANDSHAKE_MAX, so that a stranger's connection cannot make kvctl buffer a frame's worth)."""
        self.limit = limit
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        """The (control, data) of each message completed by `data`; a length beyond `limit` is a DecodeError."""
        self.push(data)
        messages = []
        while (message := self.take()) is not None:
            messages.append(message)
        return messages

    def push(self, data: bytes) -> None:
        self._buffer += data

    def take(self) -> tuple[bytes, bytes] | None:
        """The next complete message, None until one is (one at a time: `limit` may change between them)."""
        if len(self._buffer) < _TWO_PART.size:
            return None
        control_len, data_len, _checksum = _TWO_PART.unpack_from(self._buffer)
        if control_len + data_len > self.limit:
            raise TooLarge(ErrorKind.bad_batch, "two-part message",
                           f"{control_len + data_len} bytes announced, more than {self.limit}")
        end = _TWO_PART.size + control_len + data_len
        if len(self._buffer) < end:
            return None
        control = bytes(self._buffer[_TWO_PART.size:_TWO_PART.size + control_len])
        data = bytes(self._buffer[_TWO_PART.size + control_len:end])
        del self._buffer[:end]
        return control, data


def handshake_subject(control: bytes) -> str:
    """The subject a response connection's first message names (which request it answers)."""
    obj = as_map(parse_json(control), "handshake")
    subject = require(obj, "subject")
    if not isinstance(subject, str) or obj.get("stream_type") != "response":
        raise DecodeError(ErrorKind.bad_type, "handshake", f"expected a response stream's subject, got {describe(obj)}")
    return subject


class _Wrapper(msgspec.Struct):
    """A data message's msgpack: the answer kept undecoded (`Raw`) until the stream is whole, so that a stream
    cut off meanwhile costs one buffer to free, not a tree of objects."""

    data: msgspec.Raw = msgspec.Raw()
    complete_final: Any = None


_WRAPPER = msgspec.msgpack.Decoder(_Wrapper)
_NIL = 0xC0  # msgpack nil: `"data": null`


class ResponseStream:
    """One response connection's messages after its handshake, in order; `done` once the worker ended it. Only
    the first data is kept (the answer: a worker sends one), undecoded until `decode_recovery_response`."""

    def __init__(self) -> None:
        self.answer: msgspec.Raw | None = None
        self.error: str | None = None
        self.done = False

    def take(self, control: bytes, data: bytes) -> None:
        if control == SENTINEL:
            self.done = True
        elif control:
            prologue = as_map(parse_json(control), "prologue")
            if prologue.get("error") is not None:
                self.error = str(prologue["error"])
                self.done = True
        if data:
            try:
                wrapper = _WRAPPER.decode(data)
            except msgspec.ValidationError as exc:
                raise DecodeError(ErrorKind.bad_type, "response", str(exc)) from None
            except msgspec.DecodeError as exc:
                raise DecodeError(ErrorKind.bad_msgpack, "response", str(exc)) from None
            if self.answer is None and len(wrapper.data) and memoryview(wrapper.data)[0] != _NIL:
                self.answer = wrapper.data
            if wrapper.complete_final is True:
                self.done = True


def decode_recovery_response(stream: ResponseStream) -> Recovered:
    """The worker's answer to a recovery query; RecoveryRefused when it did not answer with events."""
    if stream.error is not None:
        raise RecoveryRefused(f"the worker refused the request: {stream.error}")
    if stream.answer is None:
        raise RecoveryRefused("the worker's response stream ended with no answer")
    answer = parse_msgpack(stream.answer)
    if not isinstance(answer, dict) or len(answer) != 1:
        raise DecodeError(ErrorKind.bad_type, "WorkerKvQueryResponse", f"expected one variant, got {describe(answer)}")
    ((variant, body),) = answer.items()
    if variant not in ("TreeDump", "Events"):
        raise RecoveryRefused(f"the worker answered {variant}: {str(body)[:200]}")
    body = as_map(body, variant)
    items = require(body, "events", f"{variant}.events")
    if not isinstance(items, list):
        raise DecodeError(ErrorKind.bad_type, f"{variant}.events", f"expected an array, got {describe(items)}")
    events, errors = decode_router_events(items)
    return Recovered(events, errors, as_u64(require(body, "last_event_id", f"{variant}.last_event_id"),
                                           f"{variant}.last_event_id"), reset=variant == "TreeDump")


