"""`U64Map`, the index's engine hash -> node map, in C (`u64_map.h`) and its pure-Python twin, against a dict: the
same answers after any sequence of operations (`bind_run` against the dict one, which test_native_twins holds to
C), through growth, shrinking and the deletions that shift a probe run back; and the same refusals, with the same
messages."""

from __future__ import annotations

import random
from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.core import _native_py

C = pytest.importorskip("kvctl.core._native", reason="the C extension is not built in this install")
IMPLS = [pytest.param(C.U64Map, id="C"), pytest.param(_native_py.U64Map, id="twin")]

VALUES = [object() for _ in range(4)]
_KEY = st.integers(0, 40) | st.sampled_from([2**64 - 1, 2**63, 2**32])  # few keys, so operations meet
_KEYS = st.lists(_KEY, max_size=12)
_VALUE = st.integers(0, len(VALUES) - 1)
_OPS = st.lists(st.one_of(
    st.tuples(st.just("set"), _KEY, _VALUE),
    st.tuples(st.just("del"), _KEY),
    st.tuples(st.just("pop"), _KEY),
    st.tuples(st.just("popitem")),
    st.tuples(st.just("bind_run"), _KEYS, _VALUE, st.none() | _VALUE, st.booleans()),
    st.tuples(st.just("repoint"), _KEYS, _VALUE, st.none() | _VALUE),
    st.tuples(st.just("fill"), _KEYS, _VALUE),
    st.tuples(st.just("clear")),
), max_size=60)


def _apply(m: Any, oracle: dict[int, Any], op: tuple[Any, ...]) -> None:  # noqa: C901 - one branch per operation
    name = op[0]
    if name == "set":
        m[op[1]] = oracle[op[1]] = VALUES[op[2]]
    elif name in ("del", "pop"):
        if op[1] in oracle:
            expected = oracle.pop(op[1])
            assert (m.pop(op[1]) if name == "pop" else m.__delitem__(op[1]) or expected) is expected
        else:
            with pytest.raises(KeyError):
                m.pop(op[1]) if name == "pop" else m.__delitem__(op[1])
            assert m.pop(op[1], "absent") == "absent"
    elif name == "popitem":
        if oracle:
            key, value = m.popitem()
            assert oracle.pop(key) is value
        else:
            with pytest.raises(KeyError, match="the map is empty"):
                m.popitem()
    elif name == "bind_run":
        keys, value = op[1], VALUES[op[2]]
        replaceable = None if op[3] is None else VALUES[op[3]]
        given_keys = array("Q", keys) if op[4] else keys
        assert m.bind_run(given_keys, value, replaceable) == _native_py.bind_run(oracle, keys, value, replaceable)
    elif name == "repoint":
        old, new = VALUES[op[2]], None if op[3] is None else VALUES[op[3]]
        changed = 0
        for key in op[1]:
            if key in oracle and oracle[key] is old:
                changed += 1
                if new is None:
                    del oracle[key]
                else:
                    oracle[key] = new
        assert m.repoint(array("Q", op[1]), old, new) == changed
    elif name == "fill":
        m.fill(op[1], VALUES[op[2]])
        oracle.update(dict.fromkeys(op[1], VALUES[op[2]]))
    else:
        m.clear()
        oracle.clear()


def _same(m: Any, oracle: dict[int, Any]) -> None:
    assert len(m) == len(oracle)
    assert sorted(m.items(), key=lambda kv: kv[0]) == sorted(oracle.items(), key=lambda kv: kv[0])
    for key, value in oracle.items():
        assert key in m and m[key] is value and m.get(key) is value
    assert -1 not in m and "x" not in m and m.get(2**64, "none") == "none" and m.get(None) is None


@pytest.mark.parametrize("make", IMPLS)
@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_answers_as_a_dict_does(make: Any, ops: list[tuple[Any, ...]]) -> None:
    m, oracle = make(), {}
    for op in ops:
        _apply(m, oracle, op)
        _same(m, oracle)


@pytest.mark.parametrize("make", IMPLS)
def test_growth_shrinking_and_shifted_runs(make: Any) -> None:
    """Thousands of keys in and out at random: every resize, and deletions in the middle of long probe runs."""
    rng = random.Random(7)
    m, oracle = make(), {}
    for round_ in range(6):
        for _ in range(4000):
            key = rng.getrandbits(64) if rng.random() < 0.5 else rng.randrange(5000)
            m[key] = oracle[key] = VALUES[round_ % len(VALUES)]
        doomed = rng.sample(sorted(oracle), k=len(oracle) * 3 // 4 if round_ % 2 else len(oracle) // 3)
        for key in doomed:
            assert m.pop(key) is oracle.pop(key)
        _same(m, oracle)
    while oracle:
        key, value = m.popitem()
        assert oracle.pop(key) is value
    _same(m, oracle)


def test_the_c_map_gives_its_memory_back() -> None:
    """A map that lost most of its entries is made smaller at its next store, and an emptied one holds no slots."""
    m = C.U64Map()
    m.fill(range(100_000), VALUES[0])
    full = m.__sizeof__()
    assert full >= 100_000 * 16
    m.repoint(array("Q", range(99_000)), VALUES[0], None)
    m[10**9] = VALUES[1]
    assert m.__sizeof__() < full // 16
    m.clear()
    assert m.__sizeof__() < 100


def _outcome(call: Any) -> tuple[str, str]:
    try:
        return "returned", repr(call())
    except Exception as exc:  # noqa: BLE001 - the exception is the outcome compared
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("call", [
    lambda m: m.__setitem__(-1, 1),
    lambda m: m.__setitem__(2**64, 1),
    lambda m: m.__setitem__("a", 1),
    lambda m: m.__setitem__(1.0, 1),
    lambda m: m.fill([1, -2], 1),
    lambda m: m.fill("ab", 1),
    lambda m: m.fill(5, 1),
    lambda m: m.fill(b"12345678", 1),
    lambda m: m.fill(array("I", [1, 2]), 1),
    lambda m: m.bind_run([1, 2**64], 1, None),
    lambda m: m.repoint([None], 1, None),
    lambda m: m.fill(iter([3, 4]), 1) or sorted(m.items()),
    lambda m: m.fill(array("L", [3]), 1) or sorted(m.items()),
    lambda m: m["x"],
    lambda m: m.pop(3),
    lambda m: m.popitem(),
], ids=lambda _: "")
def test_refuses_what_the_other_refuses(call: Any) -> None:
    assert _outcome(lambda: call(C.U64Map())) == _outcome(lambda: call(_native_py.U64Map()))
