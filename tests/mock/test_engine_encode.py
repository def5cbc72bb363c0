"""The encoders rebuild every captured engine payload byte for byte from its decoded expectation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvctl.core.events import decode_engine_batch
from kvctl.core.events.engine_encode import (
    SGLANG,
    VLLM,
    VLLM_LEGACY,
    VLLM_LEGACY_0_10,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    WireFormat,
    encode_batch,
    encode_event,
)
from tests.fixtures_path import FIXTURES

_FOLDERS = {
    "vllm-0.33": VLLM,
    "vllm-legacy/0.10.2": VLLM_LEGACY_0_10,
    "vllm-legacy/0.23.0": VLLM_LEGACY,
    "sglang-0.5.23": SGLANG,
}
_STORED_NAMED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_REMOVED_NAMED = ("block_hashes", "medium")


def _cases() -> list[Any]:
    cases = []
    for folder, fmt in _FOLDERS.items():
        manifest = json.loads((FIXTURES / folder / "manifest.json").read_text())
        cases += [pytest.param(fmt, FIXTURES / folder, m, id=f"{folder}/{m['file']}") for m in manifest["messages"]]
    return cases


def _unhex(value: Any) -> Any:
    """The manifest's JSON rendering back to Python values: {"__bytes_hex__": h} is bytes."""
    if isinstance(value, dict):
        return bytes.fromhex(value["__bytes_hex__"]) if "__bytes_hex__" in value else {
            k: _unhex(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unhex(v) for v in value]
    return value


def _event(raw: dict[str, Any]) -> EngineEvent:
    fields = {k: v for k, v in _unhex(raw).items() if k != "type"}
    if raw["type"] == "AllBlocksCleared":
        return AllBlocksCleared()
    named_keys = _STORED_NAMED if raw["type"] == "BlockStored" else _REMOVED_NAMED
    named = {k: fields.pop(k) for k in named_keys if k in fields}
    cls = BlockStored if raw["type"] == "BlockStored" else BlockRemoved
    return cls(**named, extra=fields)


@pytest.mark.parametrize(("fmt", "folder", "message"), _cases())
def test_payload_is_byte_identical_to_the_capture(fmt: WireFormat, folder: Path, message: dict[str, Any]) -> None:
    expected = message["decoded_expectation"]
    dp_rank = expected.get("dp_rank", expected.get("attn_dp_rank"))
    payload = encode_batch(fmt, expected["ts"], [_event(e) for e in expected["events"]], dp_rank)
    assert payload == (folder / message["file"]).read_bytes()
    assert msgspec.msgpack.decode(payload) == _unhex(message["wire_untyped"])
    batch = decode_engine_batch(payload)
    assert batch.dp_rank == dp_rank
    assert batch.ts == expected["ts"]
    # the decoder rejects only what real routers reject too: 0.23's token-less CPU placeholder
    assert len(batch.events) + len(batch.errors) == len(expected["events"])


def test_dp_rank_none_is_omitted_by_vllm_and_kept_by_sglang() -> None:
    assert msgspec.msgpack.decode(encode_batch(VLLM, 1.0, [], None)) == [1.0, []]
    assert msgspec.msgpack.decode(encode_batch(SGLANG, 1.0, [], None)) == [1.0, [], None]


def test_positional_formats_refuse_fields_they_cannot_carry() -> None:
    with pytest.raises(ValueError, match="session_id"):
        encode_event(VLLM_LEGACY, BlockStored([1], None, [1], 1, extra={"session_id": "s"}))
    with pytest.raises(ValueError, match="lora_name"):
        encode_event(VLLM_LEGACY_0_10, BlockStored([1], None, [1], 1, lora_name="sql-lora"))


def test_extras_may_not_shadow_named_fields() -> None:
    with pytest.raises(ValueError, match="medium"):
        encode_event(VLLM, BlockRemoved([1], extra={"medium": "CPU"}))


def test_unknown_map_fields_are_appended_after_the_struct_fields() -> None:
    wire = msgspec.msgpack.decode(encode_event(SGLANG, BlockRemoved([1], extra={"future_field": 7})))
    assert list(wire) == ["type", "block_hashes", "medium", "future_field"]


def test_plain_request_extras_follow_the_producer() -> None:
    assert VLLM.plain_stored_extra(2) == {"extra_keys": [None, None], "group_idx": 0}
    assert VLLM.plain_removed_extra() == {"group_idx": 0}
    assert SGLANG.plain_stored_extra(2) == {} == SGLANG.plain_removed_extra()
