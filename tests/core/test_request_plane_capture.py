"""Dynamo 1.6.1's TCP request plane as real KV recovery exchanges put it on the wire
(tests/fixtures/dynamo-1.6.1-fleet/request-plane): kvctl's request frame says what a Dynamo router's says (less
its send timestamp), the workers' event-source records name their recovery targets, and the workers' answers
(a tree dump, buffered events, TooNew) decode. Malformed shapes are DecodeErrors of stable kinds."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from kvctl.core.events import DecodeError, ErrorKind
from kvctl.core.events.request_plane import (
    ACK_MAX,
    FRAME_MAX,
    RecoveryRefused,
    ResponseStream,
    TwoPartReader,
    ack_length,
    decode_recovery_response,
    decode_request_frame,
    encode_recovery_request,
    handshake_subject,
    parse_event_source,
)
from tests.fixtures_path import FIXTURES

PLANE = FIXTURES / "dynamo-1.6.1-fleet" / "request-plane"


def exchanges(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (PLANE / name).read_text().splitlines()]


def answer(row: dict[str, Any]) -> tuple[str, ResponseStream]:
    """The handshake's subject and the rest of the worker's response stream, as captured."""
    messages = TwoPartReader().feed(bytes.fromhex(row["response_stream"]))
    stream = ResponseStream()
    for control, data in messages[1:]:
        stream.take(control, data)
    return handshake_subject(messages[0][0]), stream


@pytest.mark.parametrize("row", exchanges("recovery_capture.jsonl"), ids=["worker0", "worker1"])
def test_kvctls_request_says_what_dynamos_router_said(row: dict[str, Any]) -> None:
    target = parse_event_source(json.dumps(row["event_source"]))
    assert target is not None and target.worker_id == row["event_source"]["metadata"]["worker"]["worker_id"]
    theirs = decode_request_frame(bytes.fromhex(row["request"]))
    assert theirs.path == target.path and row["request_connection"].endswith(f"->{target.address}]")
    ours = decode_request_frame(encode_recovery_request(target, theirs.control["id"], theirs.reply["subject"],
                                                        theirs.reply["address"]))
    assert (ours.path, ours.control, ours.reply, ours.query) == (theirs.path, theirs.control, theirs.reply,
                                                                 theirs.query)
    assert ours.headers == {k: v for k, v in theirs.headers.items() if k != "x-frontend-send-ts-ns"}
    assert theirs.query == {"worker_id": target.worker_id, "dp_rank": 0, "start_event_id": None,
                            "end_event_id": None, "supports_tree_dump_failed": True, "kind": "recovery"}


@pytest.mark.parametrize("row", exchanges("recovery_capture.jsonl"), ids=["worker0", "worker1"])
def test_a_workers_tree_dump_decodes_to_its_whole_index(row: dict[str, Any]) -> None:
    assert ack_length(bytes.fromhex(row["ack"])) == 0
    subject, stream = answer(row)
    assert subject == decode_request_frame(bytes.fromhex(row["request"])).reply["subject"] and stream.done
    recovered = decode_recovery_response(stream)
    assert recovered.reset and recovered.errors == [] and recovered.last_event_id == 4
    worker = row["event_source"]["metadata"]["worker"]["worker_id"]
    assert {e.worker_id for e in recovered.events} == {worker} and len(recovered.events) == 4
    assert sum(len(e.data.block_hashes) for e in recovered.events) > 0  # type: ignore[union-attr]


def test_buffered_events_keep_their_ids_and_a_range_too_new_is_refused() -> None:
    rows = exchanges("ranged_capture.jsonl")
    starts = [decode_request_frame(bytes.fromhex(r["request"])).query["start_event_id"] for r in rows]
    assert starts == [2, 99, 2, 99]
    for row, start in zip(rows, starts, strict=True):
        _, stream = answer(row)
        if start == 2:
            recovered = decode_recovery_response(stream)
            assert not recovered.reset and [e.event_id for e in recovered.events] == [2, 3, 4]
            assert recovered.last_event_id == 4
        else:
            with pytest.raises(RecoveryRefused, match="TooNew"):
                decode_recovery_response(stream)


def test_sources_of_other_topics_have_nothing_to_recover_and_bad_records_are_decode_errors() -> None:
    record = exchanges("recovery_capture.jsonl")[0]["event_source"]
    assert parse_event_source(json.dumps({**record, "topic": "kv_metrics"})) is None
    on_nats = {**record, "metadata": {**record["metadata"], "recovery_target": {
        **record["metadata"]["recovery_target"], "transport": {"nats": "namespace.dynamo.component.backend"}}}}
    target = parse_event_source(json.dumps(on_nats))
    assert target is not None and target.transport == "nats" and target.worker_id == record["metadata"]["worker"][
        "worker_id"]
    for bad, kind in [({**record, "type": "EventChannel"}, ErrorKind.unknown_type),
                      ({**record, "metadata": {}}, ErrorKind.missing_field),
                      ({**record, "metadata": {**record["metadata"], "recovery_target": {
                          **record["metadata"]["recovery_target"], "transport": {"tcp": "no port"}}}},
                       ErrorKind.unknown_type),
                      ({**record, "publisher_id": -1}, ErrorKind.bad_type)]:
        with pytest.raises(DecodeError) as caught:
            parse_event_source(json.dumps(bad))
        assert caught.value.kind is kind


def test_two_part_messages_arrive_in_pieces_and_absurd_lengths_are_refused() -> None:
    captured = bytes.fromhex(exchanges("recovery_capture.jsonl")[0]["response_stream"])
    reader, messages = TwoPartReader(), []
    for i in range(0, len(captured), 7):
        messages += reader.feed(captured[i:i + 7])
    assert messages == TwoPartReader().feed(captured) and len(messages) == 5
    with pytest.raises(DecodeError) as caught:
        TwoPartReader().feed((FRAME_MAX + 1).to_bytes(8, "big") + bytes(16))
    assert caught.value.kind is ErrorKind.bad_batch


def test_an_error_prologue_or_an_empty_stream_is_refused() -> None:
    stream = ResponseStream()
    stream.take(b'{"error":"no such endpoint"}', b"")
    assert stream.done
    with pytest.raises(RecoveryRefused, match="no such endpoint"):
        decode_recovery_response(stream)
    with pytest.raises(RecoveryRefused, match="no answer"):
        decode_recovery_response(ResponseStream())
    odd = ResponseStream()
    odd.take(b"", msgspec.msgpack.encode({"data": {"TreeDump": {"events": 3, "last_event_id": 1}}}))
    with pytest.raises(DecodeError) as caught:
        decode_recovery_response(odd)
    assert caught.value.kind is ErrorKind.bad_type


def test_an_ack_past_its_cap_is_no_ack_and_an_http_answer_says_so() -> None:
    assert ack_length(ACK_MAX.to_bytes(4, "big")) == ACK_MAX
    for header, words in [(b"HTTP", "an HTTP server answered"), ((ACK_MAX + 1).to_bytes(4, "big"), "more than")]:
        with pytest.raises(DecodeError, match=words):
            ack_length(header)


def test_only_the_first_answer_of_a_stream_is_kept_and_it_decodes_once_whole() -> None:
    """Data messages after the answer are read for `complete_final` only: a stream that never ends keeps one."""
    def message(last_event_id: int) -> bytes:
        answer = {"Events": {"events": [], "last_event_id": last_event_id}}
        return msgspec.msgpack.encode({"data": answer, "complete_final": False})

    stream = ResponseStream()
    for last_event_id in (9, 8, 7):
        stream.take(b"", message(last_event_id))
    assert not stream.done
    stream.take(b"", msgspec.msgpack.encode({"complete_final": True}))
    assert stream.done and decode_recovery_response(stream).last_event_id == 9
