"""Engine ZMQ decoding against the real vLLM / SGLang captures and against what Dynamo 1.6.1 made of them.

Expectations are built from each manifest's `decoded_expectation` (the producer's own typed decode)
with rules written out here independently of the decoder: u64 bit-cast, bytes -> last 8 bytes BE,
tokens_hash = Dynamo's local hash of the event's token ids (with its LoRA name).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import msgspec
import pytest

from kvctl.core.events import (
    END_SEQ,
    Cleared,
    DecodeError,
    ErrorKind,
    Group,
    Rehash,
    Removed,
    Stored,
    Tier,
    decode_engine_batch,
    decode_engine_message,
    decode_replay_reply,
    encode_replay_request,
    normalize_hash,
    tier_of_medium,
)
from kvctl.core.hashing import local_block_hashes, pack_tokens
from tests.fixtures_path import FIXTURES

pytestmark = pytest.mark.usefixtures("native_impl")  # on the C extension and on its pure-Python twin

ENGINE_FOLDERS = ("vllm-0.33", "vllm-legacy/0.10.2", "vllm-legacy/0.23.0", "sglang-0.5.23")
MEDIUM_TIER = {"GPU": Tier.device, "CPU": Tier.host_pinned, "CPU_PINNED": Tier.host_pinned}
# Events the fixtures hold that kvctl must refuse, by (folder, file) -> {event index: kind}.
# vLLM 0.23's CPU-offload store is a placeholder (token_ids [], block_size 0): Dynamo drops it too.
EXPECTED_ERRORS = {("vllm-legacy/0.23.0", "j_medium_cpu.msgpack"): {0: ErrorKind.bad_block_size}}


def _manifest_cases() -> list[tuple[str, dict[str, Any]]]:
    return [
        (folder, message)
        for folder in ENGINE_FOLDERS
        for message in json.loads((FIXTURES / folder / "manifest.json").read_text())["messages"]
    ]


CASES = _manifest_cases()


def _payload(folder: str, message: dict[str, Any]) -> bytes:
    """The capture's bytes, after checking they are still the bytes the manifest describes."""
    data = (FIXTURES / folder / message["file"]).read_bytes()
    assert hashlib.sha256(data).hexdigest() == message["payload_sha256"], (
        f"{folder}/{message['file']} changed"
    )
    assert len(data) == message["payload_len"]
    return data


def _u64(value: Any) -> int:
    """The manifest's rendering of a hash, as the u64 docs/contract.md says it stands for."""
    if isinstance(value, dict):
        return int(value["__bytes_hex__"][-16:], 16)
    assert -(2**63) <= value < 2**64
    return value % 2**64


def _expected_event(ev: dict[str, Any], wire: Any) -> Stored | Removed | Cleared:
    """`ev` as its producer's typed decoder reads it; `wire` as sent (a field left at its default is not sent)."""
    if ev["type"] == "AllBlocksCleared":
        return Cleared()
    hashes = [_u64(h) for h in ev["block_hashes"]]
    tier = MEDIUM_TIER[ev["medium"]]
    sent = wire if isinstance(wire, dict) else {}
    named = sent.get("group_idx") is not None or sent.get("kv_cache_spec_kind") is not None
    if ev["type"] == "BlockRemoved":
        return Removed(hashes, tier, Group(ev.get("group_idx"), ev.get("kv_cache_spec_kind")) if named else None)
    parent = ev["parent_block_hash"]
    salt = ev.get("cache_salt") or None  # a bare salt in vLLM's extra_keys is not one Dynamo reads
    local = local_block_hashes(ev["token_ids"], ev["block_size"], lora_name=ev.get("lora_name"), cache_salt=salt)
    group = Group(ev.get("group_idx"), ev.get("kv_cache_spec_kind"), ev.get("kv_cache_spec_sliding_window"),
                  ev["block_size"]) if named else None
    return Stored(None if parent is None else _u64(parent), hashes, local[: len(hashes)], tier, group, salt)


@pytest.mark.parametrize(("folder", "message"), CASES, ids=[f"{f}/{m['file']}" for f, m in CASES])
def test_capture_decodes_as_its_manifest_says(folder: str, message: dict[str, Any]) -> None:
    frames = [
        bytes.fromhex(message["topic_hex"]),
        bytes.fromhex(message["seq_hex"]),
        _payload(folder, message),
    ]
    decoded = decode_engine_message(frames)
    expectation = message["decoded_expectation"]
    assert (decoded.topic, decoded.seq) == (message["topic"], message["seq"])
    assert decoded.batch.ts == expectation["ts"]
    assert decoded.batch.dp_rank == expectation.get("dp_rank", expectation.get("attn_dp_rank"))

    refused = EXPECTED_ERRORS.get((folder, message["file"]), {})
    assert {e.index: e.kind for e in decoded.batch.errors} == refused
    wire = message["wire_untyped"]
    sent = wire["events"] if isinstance(wire, dict) else wire[1]
    wanted = [_expected_event(ev, sent[i]) for i, ev in enumerate(expectation["events"]) if i not in refused]
    assert decoded.batch.events == wanted


def test_concrete_values_of_three_wire_forms() -> None:
    """Spot values, so a wrong rule shared by decoder and expectation builder still fails."""
    sglang = decode_engine_batch((FIXTURES / "sglang-0.5.23" / "a_block_stored_4x16.msgpack").read_bytes())
    stored = sglang.events[0]
    assert isinstance(stored, Stored)
    assert stored.block_hashes[0] == 14166355229815369834  # -4280388843894181782 bit-cast
    assert stored.tokens_hashes[0] == 17172768840257223234  # Dynamo's own tokens_hash of block 0

    vllm_bytes = decode_engine_batch((FIXTURES / "vllm-0.33" / "g_bytes_hashes.msgpack").read_bytes())
    stored = vllm_bytes.events[0]
    assert isinstance(stored, Stored)
    assert stored.block_hashes[0] == 0x100E3BE9B956BCD2
    assert stored.parent_hash == 0x4826FCDF89ED742A

    legacy = decode_engine_batch(
        (FIXTURES / "vllm-legacy" / "0.10.2" / "b_block_stored_chained.msgpack").read_bytes()
    )
    assert legacy.events == [
        Stored(
            15440481055924301332,
            [10876522392638024119, 1452986340425561248],
            [14815841638112298922, 12647329376385834986],
        )
    ]


# --- Dynamo 1.6.1's standalone indexer fed the same captures -------------------------------------


def _dump_blocks(step: dict[str, Any]) -> set[tuple[int, int, str, int]]:
    """(block_hash, tokens_hash, storage_tier, dp_rank) of every block in the indexer's /dump after a step."""
    return {
        (block["block_hash"], block["tokens_hash"], ev["storage_tier"], ev["event"]["dp_rank"])
        for model in step["dump"].values()
        for ev in model["events"]
        for block in ev["event"]["data"]["stored"]["blocks"]
    }


def _apply(state: set[tuple[int, int, str, int]], events: list[Any], dp_rank: int) -> None:
    """A set model of one worker's blocks: enough for these streams, which only evict leaves."""
    for ev in events:
        if isinstance(ev, Stored):
            state.update(
                (b, t, ev.tier.value, dp_rank) for b, t in zip(ev.block_hashes, ev.tokens_hashes, strict=True)
            )
        elif isinstance(ev, Removed):
            state.difference_update({s for s in state if s[0] in ev.block_hashes and s[2] == ev.tier.value})
        else:
            state.clear()


def _ingest_streams() -> list[dict[str, Any]]:
    return json.loads((FIXTURES / "dynamo-1.6.1" / "ingest_engine_messages.json").read_text())["streams"]


# Dynamo keeps one block_hash per radix node, set by the first worker to store it. The vLLM dp1
# stream (still live) stored the same tokens first, so Dynamo's dump shows vLLM's block hashes
# for SGLang's dp1 blocks: map them through that capture before comparing.
NODE_CREATED_BY = {"sglang-0.5.23_dp1": "vllm-0.33/f_dp_rank_1.msgpack"}


def _node_block_hashes(stream: str) -> dict[int, int]:
    """tokens_hash -> the block_hash Dynamo shows for that node (only for the stream above)."""
    if stream not in NODE_CREATED_BY:
        return {}
    batch = decode_engine_batch((FIXTURES / NODE_CREATED_BY[stream]).read_bytes())
    return {t: b for ev in batch.events for b, t in zip(ev.block_hashes, ev.tokens_hashes, strict=True)}


@pytest.mark.parametrize("stream", _ingest_streams(), ids=lambda s: s["stream"])
def test_stored_blocks_match_dynamo_indexer(stream: dict[str, Any]) -> None:
    """After every message, kvctl's decoded events give the same blocks as Dynamo's /dump.

    Where kvctl deliberately parts from Dynamo, kvctl's own behaviour is asserted instead:
    - bytes hashes (vLLM with int hashes off): Dynamo rejects the whole batch ("untagged enum
      BlockHashValue"); kvctl decodes it (last 8 bytes BE, docs/contract.md). The model skips that batch
      so the following steps still compare against Dynamo's state.
    - vLLM 0.23's CPU placeholder (block_size 0): Dynamo drops the store ("Block size must be 16");
      kvctl reports that one event as bad_block_size and still decodes the removal beside it.
    """
    state: set[tuple[int, int, str, int]] = set()
    node_hash = _node_block_hashes(stream["stream"])
    for step in stream["steps"]:
        batch = decode_engine_batch((FIXTURES / step["file"]).read_bytes())
        log = " ".join(step["indexer_log"])
        stored = [ev for ev in batch.events if isinstance(ev, Stored)]
        dynamo_local = [
            h.get("with_lora_name", h["plain"])
            for h in step["compute_block_hash_for_seq_of_stored_token_ids"]
        ]
        assert [s.tokens_hashes for s in stored] == dynamo_local
        if "Failed to decode KvEventBatch" in log:
            assert not batch.errors and [type(ev) for ev in batch.events] == [Stored, Removed]
            continue
        if "Block size must be" in log:
            assert [e.kind for e in batch.errors] == [ErrorKind.bad_block_size]
            assert [type(ev) for ev in batch.events] == [Removed]
        _apply(state, batch.events, batch.dp_rank)
        shown = {(node_hash.get(t, b), t, tier, dp) for b, t, tier, dp in state}
        assert shown == _dump_blocks(step), step["file"]


# --- replay ------------------------------------------------------------------------------------------


def _replay_exchanges(folder: str) -> list[tuple[int, list[str], list[tuple[list[str], str | None]]]]:
    """(start_seq, request frames, [(reply frames, replayed file or None)]) of a folder's replay.json.

    vllm-0.33 records several exchanges with the replayed files listed per exchange; the other
    folders record one exchange with the file on each reply.
    """
    data = json.loads((FIXTURES / folder / "replay.json").read_text())
    out = []
    for exchange in data.get("exchanges", [data]):
        replies = exchange["replies"]
        if all("file" in r for r in replies):
            files = [r["file"] for r in replies]
        else:
            files = [*exchange.get("replayed_files", []), None]
        out.append(
            (
                exchange["start_seq"],
                exchange["request_frames_hex"],
                list(zip([r["frames_hex"] for r in replies], files, strict=True)),
            )
        )
    return out


@pytest.mark.parametrize("folder", ENGINE_FOLDERS)
def test_replay_frames_parse(folder: str) -> None:
    has_topic = folder in ("vllm-0.33", "sglang-0.5.23")
    seqs = {
        m["file"]: m["seq"] for m in json.loads((FIXTURES / folder / "manifest.json").read_text())["messages"]
    }
    for start_seq, request_hex, replies in _replay_exchanges(folder):
        assert encode_replay_request(start_seq) == [bytes.fromhex(h) for h in request_hex]
        decoded = [decode_replay_reply([bytes.fromhex(h) for h in frames]) for frames, _ in replies]
        assert [r.end for r in decoded] == [False] * (len(decoded) - 1) + [True]
        assert all(r.topic == ("" if has_topic else None) for r in decoded)
        assert decoded[-1].seq == END_SEQ and decoded[-1].payload is None
        for reply, (_, file) in zip(decoded[:-1], replies[:-1], strict=True):
            assert file is not None and reply.seq == seqs[file]
            assert reply.payload == (FIXTURES / folder / file).read_bytes()
            assert decode_engine_batch(reply.payload).events


def test_replay_reply_shapes_rejected() -> None:
    seq = (5).to_bytes(8, "big")
    for frames in (
        [b"", seq],
        [b"x", seq, b"\x90"],
        [b"", b"\x00" * 7, b"\x90"],
        [b"", b"\xff" * 8, b"\x90"],
    ):
        with pytest.raises(DecodeError) as info:
            decode_replay_reply(frames)
        assert info.value.kind is ErrorKind.bad_batch
    with pytest.raises(ValueError):
        encode_replay_request(-1)


# --- frames, batches, events: the rules beyond the captures ---------------------------------------


def _pack(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def _stored_map(**fields: Any) -> dict[str, Any]:
    event = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None}
    event |= {"token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU"}
    return event | fields


def _decode_one(event: Any, **kwargs: Any) -> Stored | Removed | Cleared:
    batch = decode_engine_batch(_pack([1.5, [event], 0]), **kwargs)
    assert not batch.errors, batch.errors
    return batch.events[0]


def _refusal(event: Any) -> DecodeError:
    batch = decode_engine_batch(_pack([1.5, [{"type": "AllBlocksCleared"}, event], 0]))
    assert batch.events == [Cleared()] and len(batch.errors) == 1 and batch.errors[0].index == 1
    return batch.errors[0]


@pytest.mark.parametrize(
    "frames",
    [
        [b"", b"\x00" * 8],
        [b"", b"\x00" * 8, b"\x90", b""],
        [b"", b"\x00" * 9, b"\x92\x00\x90"],
        [b"\xff", b"\x00" * 8, b"\x92\x00\x90"],
    ],
)
def test_engine_message_frame_shapes_rejected(frames: list[bytes]) -> None:
    with pytest.raises(DecodeError) as info:
        decode_engine_message(frames)
    assert info.value.kind is ErrorKind.bad_batch


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        (b"\xc1", ErrorKind.bad_msgpack),
        (b"\x91" * 5000, ErrorKind.bad_msgpack),
        (_pack("batch"), ErrorKind.bad_batch),
        (_pack([1.0]), ErrorKind.bad_batch),
        (_pack([1.0, {"type": "AllBlocksCleared"}]), ErrorKind.bad_batch),
        (_pack(["now", []]), ErrorKind.bad_batch),
        (_pack([1.0, [], -1]), ErrorKind.bad_batch),
        (_pack({"events": []}), ErrorKind.bad_batch),
    ],
)
def test_unusable_batches_raise(payload: bytes, kind: ErrorKind) -> None:
    with pytest.raises(DecodeError) as info:
        decode_engine_batch(payload)
    assert info.value.kind is kind and info.value.index is None


@pytest.mark.parametrize(
    ("batch", "dp_rank"),
    [
        ([2.0, []], None),  # no rank named: the stream's registered one, as Dynamo takes it
        ([2.0, [], None], None),
        ([2, [], 3, "future"], 3),
        ({"ts": 2.0, "events": [], "data_parallel_rank": 4}, 4),
        ({"ts": 2.0, "events": [], "dp_rank": 5}, 5),
        ({"ts": 2.0, "events": [], "attn_dp_rank": 6}, 6),
        ({"ts": 2.0, "events": []}, None),
    ],
)
def test_batch_shapes(batch: Any, dp_rank: int | None) -> None:
    decoded = decode_engine_batch(_pack(batch))
    assert (decoded.ts, decoded.dp_rank, decoded.events, decoded.errors) == (2.0, dp_rank, [], [])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (2**64 - 1, 2**64 - 1),
        (-1, 2**64 - 1),
        (-(2**63), 2**63),
        (b"\x01\x02", 0x0102),
        (bytes(range(32)), int.from_bytes(bytes(range(24, 32)), "big")),
    ],
)
def test_hash_normalisation(value: Any, expected: int) -> None:
    assert normalize_hash(value, "h") == expected


@pytest.mark.parametrize("value", [-(2**63) - 1, 2**64, 1.0, "12", b"", None, True, [1]])
def test_bad_hashes(value: Any) -> None:
    with pytest.raises(DecodeError) as info:
        normalize_hash(value, "block_hashes")
    assert info.value.kind is ErrorKind.bad_hash and "block_hashes" in str(info.value)


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        (None, Tier.device),
        ("", Tier.device),
        ("GPU", Tier.device),
        ("DEVICE", Tier.device),
        ("CPU", Tier.host_pinned),
        ("CPU_PINNED", Tier.host_pinned),
        ("CPU_TIER1", Tier.host_pinned),
        ("DISK", Tier.disk),
        ("STORAGE", Tier.disk),
        ("NVME", Tier.disk),
        ("CPU_TIER2", Tier.disk),
        ("EXTERNAL", Tier.external),
        ("REMOTE", Tier.external),
        ("NETWORK", Tier.external),
        ("SHARED", Tier.external),
    ],
)
def test_medium_to_tier(medium: str | None, tier: Tier) -> None:
    """Dynamo 1.6.1's table, exactly (observed on its standalone indexer)."""
    assert tier_of_medium(medium) is tier
    assert _decode_one({"type": "BlockRemoved", "block_hashes": [7], "medium": medium}) == Removed([7], tier)


@pytest.mark.parametrize("medium", ["gpu", "Storage", "cpu_pinned", "FS", "kvcr", "HBM"])
def test_media_dynamo_does_not_know_are_dropped_and_counted(medium: str) -> None:
    """Dynamo matches media case-sensitively and drops the events of any other medium: so does kvctl, counted."""
    assert tier_of_medium(medium) is None
    for event in ({"type": "BlockRemoved", "block_hashes": [7], "medium": medium},
                  {"type": "BlockStored", "block_hashes": [7], "token_ids": [1, 2], "block_size": 2, "medium": medium}):
        batch = decode_engine_batch(_pack([1.5, [event], 0]))
        assert (batch.events, batch.errors, batch.filtered) == ([], [], ["unknown_medium"])


def test_positional_events_of_every_length() -> None:
    """vLLM-early (no medium), 0.10.2 (7 items) and 0.23 (12 items) positional stores decode alike."""
    tokens = list(range(8))
    expected = Stored(None, [1, 2], local_block_hashes(tokens, 4))
    for tail in ([], [None, "GPU"], [None, "GPU", None, [None, None], 0, None, None, "future"]):
        assert _decode_one(["BlockStored", [1, 2], None, tokens, 4, *tail]) == expected
    assert _decode_one(["BlockRemoved", [-1]]) == Removed([2**64 - 1])
    assert _decode_one(["AllBlocksCleared", "future"]) == Cleared()


def test_stored_rules() -> None:
    plain = local_block_hashes(list(range(8)), 4)
    assert _decode_one(_stored_map(future_field={"x": 1})).tokens_hashes == plain
    assert _decode_one(_stored_map(token_ids=list(range(11)))).tokens_hashes == plain  # tail ignored
    assert _decode_one(_stored_map(lora_name="sql-lora")).tokens_hashes == local_block_hashes(
        list(range(8)), 4, lora_name="sql-lora"
    )
    assert _decode_one(_stored_map(extra_keys=[["a" * 64], "salt"])).tokens_hashes == plain
    # A block size other than the model's is Dynamo's "Block not published": every block cut, counted.
    assert _decode_one(_stored_map(block_hashes=[1]), default_block_size=8) == Stored(
        None, [], [], cut="block_size_mismatch", cut_blocks=1)
    no_size = {k: v for k, v in _stored_map().items() if k != "block_size"}
    assert _decode_one(no_size, default_block_size=2).tokens_hashes == local_block_hashes(list(range(4)), 2)


def test_token_ids_are_kept_only_for_an_unsalted_store_with_a_parent_when_asked() -> None:
    """What the stream needs to hash a store under a salted parent's salt (`Rehash`), and nothing else."""
    tokens = list(range(8))
    child = {**_stored_map(), "parent_block_hash": 9, "lora_name": "ad"}
    kept = decode_engine_batch(_pack([1.5, [child], 0]), keep_tokens=True).events[0]
    assert isinstance(kept, Stored) and kept.rehash == Rehash(pack_tokens(tokens).tobytes(), 4, "ad", False)
    for event, keep in ((child, False), (_stored_map(), True), ({**child, "cache_salt": "s"}, True)):
        decoded = decode_engine_batch(_pack([1.5, [event], 0]), keep_tokens=keep).events[0]
        assert isinstance(decoded, Stored) and decoded.rehash is None, event


@pytest.mark.parametrize(
    ("event", "kind", "field"),
    [
        (_stored_map(token_ids=[], block_size=0), ErrorKind.bad_block_size, "block_size"),
        (_stored_map(block_size=-4), ErrorKind.bad_block_size, "block_size"),
        (_stored_map(block_size=4.0), ErrorKind.bad_block_size, "block_size"),
        # past u32 (Dynamo's type): once an OverflowError in the hashing that lost the whole batch
        (_stored_map(block_hashes=[], token_ids=[], block_size=2**62), ErrorKind.bad_block_size, "block_size"),
        (["BlockStored", [], None, [], 2**62], ErrorKind.bad_block_size, "block_size"),
        (_stored_map(block_hashes=[], token_ids=[], block_size=2**32), ErrorKind.bad_block_size, "block_size"),
        (_stored_map(block_size=None), ErrorKind.missing_field, "block_size"),
        (_stored_map(token_ids=[0, 1, 2, 2**32, 4, 5, 6, 7]), ErrorKind.bad_tokens, "token_ids"),
        (_stored_map(token_ids=[0, 1, 2, -1, 4, 5, 6, 7]), ErrorKind.bad_tokens, "token_ids"),
        (_stored_map(token_ids=[0, 1, 2, "3", 4, 5, 6, 7]), ErrorKind.bad_tokens, "token_ids"),
        (_stored_map(token_ids="01234567"), ErrorKind.bad_tokens, "token_ids"),
        (_stored_map(block_hashes=[1, 1.5]), ErrorKind.bad_hash, "block_hashes"),
        (_stored_map(block_hashes=None), ErrorKind.bad_hash, "block_hashes"),
        (_stored_map(parent_block_hash="p"), ErrorKind.bad_hash, "parent_block_hash"),
        (_stored_map(medium=3), ErrorKind.bad_tier, "medium"),
        (_stored_map(lora_name=7), ErrorKind.bad_type, "lora_name"),
        ({"type": "BlockStored", "block_hashes": [], "block_size": 4}, ErrorKind.missing_field, "token_ids"),
        ({"type": "BlockRemoved"}, ErrorKind.missing_field, "block_hashes"),
        ({"block_hashes": [1]}, ErrorKind.missing_field, "type"),
        ({"type": "BlockMoved"}, ErrorKind.unknown_type, "type"),
        ({"type": ["BlockStored"]}, ErrorKind.unknown_type, "type"),
        ([], ErrorKind.missing_field, "type"),
        ([None], ErrorKind.unknown_type, "type"),
        (42, ErrorKind.bad_type, "event"),
    ],
)
def test_bad_event_is_reported_and_skipped(event: Any, kind: ErrorKind, field: str) -> None:
    error = _refusal(event)
    assert (error.kind, error.field) == (kind, field)
    assert str(error).startswith(f"event 1: {kind.value}: {field}: ")
