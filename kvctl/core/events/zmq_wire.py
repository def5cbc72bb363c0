"""Dynamo 1.6.1's ZMQ event plane on the wire (docs/contract.md): one message, four frames.

Each publisher has a PUB socket per topic and sends `[topic (ASCII), publisher_id (u64 BE), sequence (u64 BE),
0x01 + u32 BE length + the msgpack envelope]`. The envelope is the same as on NATS (core/events/dynamo.py), so a
decoded message goes to the same ingest; only these frames are the ZMQ plane's own. No I/O: the socket is the
server's (server/plane/zmq_plane.py).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvctl.core.events.errors import DecodeError, ErrorKind

FRAMES = 4
ENVELOPE_VERSION = 1
"""The first byte of the envelope frame: the framing's version (1 in Dynamo 1.6.1)."""
_HEADER = struct.Struct(">BI")  # version, envelope length
_U64 = struct.Struct(">Q")
TOPIC_MAX = 256
"""A topic frame longer than this is not a topic (Dynamo's are ~20 bytes)."""


@dataclass(frozen=True, slots=True)
class ZmqMessage:
    """What the frames say; `envelope` is still msgpack, for `decode_envelope` (the ingest's to read)."""

    topic: str
    publisher_id: int
    sequence: int
    envelope: bytes


def decode_zmq_message(frames: Sequence[bytes]) -> ZmqMessage:
    """The four frames of one message; any other shape is a DecodeError (bad_batch for the framing,
    bad_type for a topic that is not ASCII, unknown_type for a framing version other than 1)."""
    if len(frames) != FRAMES:
        raise DecodeError(ErrorKind.bad_batch, "frames", f"expected {FRAMES} frames, got {len(frames)}")
    topic_frame, publisher_frame, sequence_frame, body = (bytes(f) for f in frames)
    if not 0 < len(topic_frame) <= TOPIC_MAX or not topic_frame.isascii():
        raise DecodeError(ErrorKind.bad_type, "frames.topic", f"expected 1-{TOPIC_MAX} ASCII bytes, "
                                                              f"got {len(topic_frame)} bytes")
    publisher_id = _u64(publisher_frame, "frames.publisher_id")
    sequence = _u64(sequence_frame, "frames.sequence")
    if len(body) < _HEADER.size:
        raise DecodeError(ErrorKind.bad_batch, "frames.envelope", f"expected a {_HEADER.size}-byte header, "
                                                                  f"got {len(body)} bytes")
    version, length = _HEADER.unpack_from(body)
    if version != ENVELOPE_VERSION:
        raise DecodeError(ErrorKind.unknown_type, "frames.envelope.version", f"unknown framing version {version}")
    if length != len(body) - _HEADER.size:
        raise DecodeError(ErrorKind.bad_batch, "frames.envelope.length",
                          f"header says {length} bytes, the frame holds {len(body) - _HEADER.size}")
    return ZmqMessage(topic_frame.decode("ascii"), publisher_id, sequence, body[_HEADER.size:])


def encode_zmq_message(message: ZmqMessage) -> list[bytes]:
    """The frames Dynamo 1.6.1 sends for a message (kvctl's tests publish with it)."""
    return [message.topic.encode("ascii"), _U64.pack(message.publisher_id), _U64.pack(message.sequence),
            _HEADER.pack(ENVELOPE_VERSION, len(message.envelope)) + message.envelope]


def _u64(frame: bytes, field: str) -> int:
    if len(frame) != _U64.size:
        raise DecodeError(ErrorKind.bad_batch, field, f"expected 8 bytes (u64 BE), got {len(frame)}")
    return int(_U64.unpack(frame)[0])
