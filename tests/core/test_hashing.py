"""Dynamo's block hashes: every vector produced by Dynamo 1.6.1's own binary, through the Python API."""

from __future__ import annotations

import json
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from kvctl.core import native
from kvctl.core.hashing import block_seed, local_block_hashes, pack_tokens, packed_block_hashes, sequence_hashes
from tests.fixtures_path import FIXTURES

VECTORS = json.loads((FIXTURES / "hashes" / "dynamo-1.6.1.json").read_text())

pytestmark = pytest.mark.usefixtures("native_impl")  # on the C extension and on its pure-Python twin


def _tokens(case: dict) -> list[int]:
    tokens = case["tokens"]
    assert len(tokens) == case["num_tokens"], "the fixture lists every token"
    return tokens


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda c: c["case"])
def test_local_and_sequence_hashes_equal_dynamo(case: dict) -> None:
    local = local_block_hashes(_tokens(case), case["block_size"])
    assert local == case["local_block_hashes_u64"]
    assert sequence_hashes(local) == case["sequence_hashes_u64"]


LORA = [v for v in VECTORS["variants"] if "lora_name" in v["kwargs"]]
MM = [v for v in VECTORS["variants"] if "block_mm_infos" in v["kwargs"]]


@pytest.mark.parametrize("variant", LORA, ids=lambda v: v["case"])
def test_lora_name_is_folded_into_the_seed(variant: dict) -> None:
    got = local_block_hashes(variant["tokens"], variant["block_size"], lora_name=variant["kwargs"]["lora_name"])
    assert got == variant["local_block_hashes_u64"]


@pytest.mark.parametrize("variant", MM, ids=lambda v: v["case"])
def test_multimodal_hashes_are_appended_sorted(variant: dict) -> None:
    infos = variant["kwargs"]["block_mm_infos"]
    mm = {i: [o["mm_hash"] for o in info["mm_objects"]] for i, info in enumerate(infos) if info}
    assert local_block_hashes(variant["tokens"], variant["block_size"], mm_hashes=mm) == variant[
        "local_block_hashes_u64"]


def test_design_examples() -> None:
    assert local_block_hashes([1, 2, 3, 4], 4) == [14643705804678351452]
    local = local_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert local == [14643705804678351452, 16777012769546811212]
    assert sequence_hashes(local)[1] == 4945711292740353085


def test_empty_lora_name_and_salt_mean_none() -> None:
    assert block_seed("", "") == block_seed(None, None) == block_seed() == 1337


SALTED = [v for v in VECTORS["variants"] if "cache_namespace" in v["kwargs"]]
EAGLE = [v for v in VECTORS["variants"] if v["kwargs"].get("is_eagle")]


@pytest.mark.parametrize("variant", SALTED, ids=lambda v: v["case"])
def test_cache_salt_changes_only_the_seed_as_dynamo_does(variant: dict) -> None:
    """Dynamo 1.6.1's `cache_namespace` vectors, which this fixture left opaque: the salt, hashed with seed 1,
    is added to the seed."""
    salt = variant["kwargs"]["cache_namespace"]
    assert local_block_hashes(variant["tokens"], variant["block_size"], cache_salt=salt) == variant[
        "local_block_hashes_u64"]
    assert local_block_hashes(variant["tokens"], variant["block_size"]) != variant["local_block_hashes_u64"]


@pytest.mark.parametrize("variant", EAGLE, ids=lambda v: v["case"])
def test_eagle_blocks_hash_one_token_more_overlapping_as_dynamo_does(variant: dict) -> None:
    """Dynamo 1.6.1's `is_eagle` vectors: block i hashes tokens [iB, iB + B + 1)."""
    tokens, size = variant["tokens"], variant["block_size"]
    got = packed_block_hashes(tokens, size, eagle=True).tolist()
    assert got == variant["local_block_hashes_u64"]
    assert len(got) == (len(tokens) - 1) // size
    assert packed_block_hashes(tokens[:-1], size, eagle=True).tolist() == got[:-1]  # nB tokens make n - 1 blocks


def test_salt_and_lora_both_fold_into_the_seed() -> None:
    """Vectors computed by Dynamo 1.6.1's `compute_block_hash_for_seq` (docs/contract.md)."""
    assert local_block_hashes(list(range(1, 5)), 4, lora_name="x", cache_salt="abc") == [16952943150278192909]
    assert local_block_hashes(list(range(1, 9)), 4, lora_name="ad", cache_salt="s1") == [
        1913161269847530638, 11706537663988974315]
    assert packed_block_hashes(list(range(1, 10)), 4, cache_salt="abc", eagle=True).tolist() == [
        8193509459896728495, 1235186127040339240]


def test_block_size_zero_gives_no_hashes() -> None:
    assert local_block_hashes([1, 2, 3], 0) == []


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_tokens_outside_u32_are_rejected(bad: int) -> None:
    with pytest.raises(ValueError, match="u32"):
        local_block_hashes([1, bad], 1)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=80), st.integers(1, 9))
def test_matches_a_plain_per_block_reference(tokens: list[int], block_size: int) -> None:
    expected = [
        xxh3_64_intdigest(b"".join(t.to_bytes(4, "little") for t in tokens[i : i + block_size]), seed=1337)
        for i in range(0, len(tokens) - block_size + 1, block_size)
    ]
    assert local_block_hashes(tokens, block_size) == expected
    assert bytes(pack_tokens(tokens)) == b"".join(t.to_bytes(4, "little") for t in tokens)


@given(st.binary(max_size=3000), st.sampled_from([1, 4, 16, 17, 64, 128, 129, 240, 241, 256, 1024]),
       st.integers(0, 2**64 - 1))
def test_block_hashing_equals_the_xxhash_package(data: bytes, stride: int, seed: int) -> None:
    """Strides span every XXH3 length class (≤16, ≤128, ≤240, long), where the algorithm changes."""
    expected = [xxh3_64_intdigest(data[i : i + stride], seed=seed) for i in range(0, len(data) - stride + 1, stride)]
    assert array("Q", native.xxh3_blocks(data, stride, seed)) == array("Q", expected)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(1, 40), st.sampled_from([None, "", "adapter-7"]))
def test_packed_block_hashes_are_the_local_hashes(tokens: list[int], block_size: int, lora: str | None) -> None:
    packed = packed_block_hashes(tokens, block_size, lora_name=lora)
    assert packed.typecode == "Q"
    assert packed.tolist() == local_block_hashes(tokens, block_size, lora_name=lora)


@given(st.lists(st.integers(0, 2**64 - 1), max_size=40))
def test_sequence_hashes_chain_like_the_definition(local: list[int]) -> None:
    expected, prev = [], None
    for h in local:
        prev = h if prev is None else xxh3_64_intdigest(prev.to_bytes(8, "little") + h.to_bytes(8, "little"), seed=1337)
        expected.append(prev)
    assert sequence_hashes(local) == expected
    assert sequence_hashes(tuple(local)) == expected


@pytest.mark.parametrize("bad", [-1, 2**64])
def test_sequence_hashes_refuse_hashes_outside_u64(bad: int) -> None:
    with pytest.raises(OverflowError):
        sequence_hashes([1, bad])
