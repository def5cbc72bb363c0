"""A worker written `ID:DP` reads back as itself, and anything else is refused saying what was wanted."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl.core.names import MAX_DP_RANK, MAX_WORKER_ID, format_worker, implied_model, parse_worker, selects

worker_ids = st.integers(0, MAX_WORKER_ID)
dp_ranks = st.integers(0, MAX_DP_RANK)


@given(worker_ids, dp_ranks)
def test_a_formatted_worker_parses_back(worker_id: int, dp_rank: int) -> None:
    assert parse_worker(format_worker((worker_id, dp_rank))) == (worker_id, dp_rank)


@given(worker_ids, dp_ranks, dp_ranks)
def test_an_id_selects_every_rank_and_id_dp_one(worker_id: int, dp_rank: int, other: int) -> None:
    assert selects(parse_worker(str(worker_id)), (worker_id, other))
    assert selects(parse_worker(f"{worker_id}:{dp_rank}"), (worker_id, other)) == (dp_rank == other)
    assert not selects((worker_id, None), (worker_id + 1, dp_rank))


@pytest.mark.parametrize(("text", "says"), [
    ("x", "ID or ID:DP"), ("3:", "ID or ID:DP"), ("3:0:1", "ID or ID:DP"), ("", "ID or ID:DP"),
    ("+3", "ID or ID:DP"), ("1_0", "ID or ID:DP"), ("3: 1", "ID or ID:DP"), ("\u0663", "ID or ID:DP"),
    ("9" * 5000, "ID or ID:DP"),
    ("-1", "0..2^64-1"), (str(2**64), "0..2^64-1"), ("3:-1", "0..2^32-1"), (f"3:{2**32}", "0..2^32-1"),
])
def test_a_bad_worker_is_refused_saying_what_is_wanted(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("^", r"\^").replace(".", r"\.")):
        parse_worker(text)


def test_the_implied_model_is_default_unless_one_other_model_alone_has_workers() -> None:
    assert implied_model({}) == ("default", None)
    assert implied_model({"default": 0, "mock": 4}) == ("mock", None)
    assert implied_model({"default": 1, "mock": 4}) == ("default", None)
    model, note = implied_model({"a": 1, "b": 2})
    assert model == "default" and note == ("model 'default' has no workers; models with workers: a (1 worker), "
                                           "b (2 workers); pass -m MODEL")
