"""Dynamo 1.6.1's model cards as its workers file them (captured: tests/fixtures/dynamo-1.6.1-fleet), and what a
card that is not one gets: a DecodeError of the kind, naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvctl.core.events.discovery import decode_file_name
from kvctl.core.events.errors import DecodeError, ErrorKind
from kvctl.core.events.model_card import ModelCard, cards_prefix, is_card_key_rest, parse_model_card
from tests.fixtures_path import FIXTURES
from tests.support.records import DROP, rewritten

FLEET = FIXTURES / "dynamo-1.6.1-fleet"
FILE_CARDS = sorted((FLEET / "zmq-plane" / "file-discovery" / "v1" / "mdc").iterdir())


def _kube_cards() -> dict[str, Any]:
    listing = json.loads((FLEET / "kubernetes" / "dynamoworkermetadatas.list.json").read_text())
    return {key: card for item in listing["items"] for key, card in item["spec"]["data"]["model_cards"].items()}


@pytest.mark.parametrize("path", FILE_CARDS, ids=lambda p: p.name)
def test_a_file_discovery_card_reads_as_the_router_uses_it(path: Path) -> None:
    key = "v1/mdc/" + decode_file_name(path.name)
    card = parse_model_card(path.read_bytes())
    assert key.startswith(cards_prefix("dynamo")) and is_card_key_rest(key.removeprefix("v1/mdc/"))
    assert key.endswith(f"/{card.instance_id:x}")  # the key names the instance its card describes
    assert card == ModelCard(instance_id=card.instance_id, namespace="dynamo", component="backend",
                             endpoint="generate", model="tiny", block_size=16, total_kv_blocks=96, role="aggregated",
                             max_num_batched_tokens=8192,
                             publishes_kv_events=True, dp_start=0, dp_size=1)
    assert list(card.ranks) == [0]


def test_kubernetes_cards_are_the_same_records_keyed_without_the_bucket() -> None:
    cards = _kube_cards()
    assert cards and all(is_card_key_rest(key) for key in cards)
    for key, record in cards.items():
        card = parse_model_card(json.dumps(record))
        assert key == f"dynamo/backend/generate/{card.instance_id:x}" and card.model == "tiny"


def _card(**changes: Any) -> bytes:
    return rewritten(FILE_CARDS[0].read_bytes(), **changes)


def test_a_disaggregated_decode_card_says_it_publishes_no_events() -> None:
    card = parse_model_card(_card(card_json__worker_type="decode",
                                  card_json__runtime_config__kv_event_publishing_enabled=False,
                                  card_json__runtime_config__data_parallel_start_rank=2,
                                  card_json__runtime_config__data_parallel_size=2))
    assert card.role == "decode" and not card.publishes_kv_events and list(card.ranks) == [2, 3]


def test_an_eagle_worker_says_so_in_its_card() -> None:
    """dynamo.sglang sets runtime_config.enable_eagle for EAGLE speculative decoding; the captures say false."""
    assert not parse_model_card(FILE_CARDS[0].read_bytes()).eagle
    assert parse_model_card(_card(card_json__runtime_config__enable_eagle=True)).eagle


def test_fields_not_advertised_are_none_not_guessed() -> None:
    card = parse_model_card(_card(card_json__kv_cache_block_size=None, card_json__runtime_config=DROP))
    assert card.block_size is None and card.total_kv_blocks is None and card.publishes_kv_events
    assert (card.dp_start, card.dp_size) == (0, 1)


@pytest.mark.parametrize(("changes", "kind", "field"), [
    ({"type": "EventChannel"}, ErrorKind.unknown_type, "type"),
    ({"instance_id": -1}, ErrorKind.bad_type, "instance_id"),
    ({"card_json": DROP}, ErrorKind.missing_field, "card_json"),
    ({"card_json__display_name": ""}, ErrorKind.bad_type, "card_json.display_name"),
    ({"card_json__kv_cache_block_size": 0}, ErrorKind.bad_type, "card_json.kv_cache_block_size"),
    ({"card_json__worker_type": "router"}, ErrorKind.bad_type, "card_json.worker_type"),
    ({"card_json__runtime_config__total_kv_blocks": "96"}, ErrorKind.bad_type,
     "card_json.runtime_config.total_kv_blocks"),
    ({"card_json__runtime_config__kv_event_publishing_enabled": 1}, ErrorKind.bad_type,
     "card_json.runtime_config.kv_event_publishing_enabled"),
    ({"card_json__runtime_config__enable_eagle": "yes"}, ErrorKind.bad_type, "card_json.runtime_config.enable_eagle"),
])
def test_a_card_that_is_not_one_is_named(changes: dict[str, Any], kind: ErrorKind, field: str) -> None:
    with pytest.raises(DecodeError) as caught:
        parse_model_card(_card(**changes))
    assert caught.value.kind is kind and caught.value.field == field


def test_bytes_that_are_not_json_are_a_decode_error() -> None:
    with pytest.raises(DecodeError):
        parse_model_card(b"\xff{")
