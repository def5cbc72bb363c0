"""Hostile config: the client's contexts file (`kvctl.config`), `kvctl serve --config` (`config_file`) and its
`--worker` flags.

Arbitrary text and bytes, and valid TOML with any one value replaced by a value of another TOML type (or
deleted, or joined by an unknown key): only the documented error comes out (`ConfigError`),
and when one value is wrong, its message names that key. What loads is usable as it is.
"""

from __future__ import annotations

import copy
import datetime as dt
import math
import re
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvctl.commands.serve import parse_engine
from kvctl.config import ConfigFile, resolve
from kvctl.config.writer import toml_string
from kvctl.errors import ConfigError, UsageError
from kvctl.server.config_file import load
from kvctl.server.ingest.endpoint import check_endpoint
from kvctl.server.state import Fleet
from tests.fuzz.junk import paths

SERVE = {
    "models": [{"name": "llama", "block_size": 32, "overlap_score_weight": 1.0, "temperature": 0.0,
                "active_decode_blocks_threshold": 0.9, "active_prefill_tokens_threshold": 20000,
                "active_prefill_tokens_threshold_frac": 4.0}],
    "workers": [{"worker_id": 1, "dp_rank": 0, "endpoint": "tcp://10.0.0.1:5557",
                 "replay_endpoint": "tcp://10.0.0.1:5600", "model": "llama", "topic": ""}],
}
CLIENT = {"current-context": "prod", "contexts": {"prod": {
    "server": "http://router:7433", "token": "s3cret", "prometheus": "http://prom:9090", "timeout": 5}}}

_KEYS = st.sampled_from(["name", "model", "models", "workers", "contexts", "server", "timeout", "x", "block_sise"])
TOML_SCALARS = (
    st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, -1, 2**63 - 1, 2**64, 10**400, 1.5, math.nan, math.inf, -math.inf, "", "tcp://*:1"])
    | st.floats()
    | st.text(max_size=12)
    | st.datetimes()
    | st.dates()
    | st.times()
)
TOML_VALUES = st.recursive(
    TOML_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS | st.text(min_size=1, max_size=6), inner,
                                                                max_size=3),
    max_leaves=8,
)
_BARE = re.compile(r"[A-Za-z0-9_-]+")


def toml(value: Any) -> str:
    """A TOML value (inline tables and arrays for containers)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else "inf" if value == math.inf else "-inf" if value == -math.inf else (
            repr(value))
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, dt.date | dt.time):  # datetime is a date
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    return "{" + ", ".join(f"{_key(k)} = {toml(v)}" for k, v in value.items()) + "}"


def _key(name: str) -> str:
    return name if _BARE.fullmatch(name) else toml_string(name)


def document(data: dict[str, Any]) -> str:
    """A whole file as top-level `key = value` lines: `[[models]]` tables as an array of inline tables."""
    return "".join(f"{_key(k)} = {toml(v)}\n" for k, v in data.items())


def _names_in(value: Any) -> set[str]:
    """The keys and indexes inside a value: a container put in place of a value may be wrong inside."""
    if isinstance(value, dict):
        return {str(k) for k in value} | {n for v in value.values() for n in _names_in(v)}
    if isinstance(value, list):
        return {f"[{i}]" for i in range(len(value))} | {n for v in value for n in _names_in(v)}
    return set()


@st.composite
def one_wrong(draw: st.DrawFn, seed: dict[str, Any]) -> tuple[str, set[str] | None]:
    """(TOML text, the names one of which its message must hold) for `seed` with one value replaced, deleted or
    added: the key, or for a container put there, a key or index inside it."""
    data = copy.deepcopy(seed)
    path = draw(st.sampled_from([p for p in paths(data) if p]))
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    action = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add"]))
    last = path[-1]
    named = f"[{last}]" if isinstance(last, int) else str(last)
    value = draw(TOML_VALUES)
    if action == "replace":
        parent[last] = value
    elif action == "delete":  # the key may be optional, or its absence be named by what needed it
        del parent[last]
        return document(data), None
    elif isinstance(parent, dict):
        named = draw(st.sampled_from(["bogus", "block_sise", "workerid"]))
        parent[named] = value
    else:
        parent.append(value)
        named = f"[{len(parent) - 1}]"
    return document(data), {named} | _names_in(value)


def _garbled(seed: dict[str, Any]) -> st.SearchStrategy[str]:
    text = document(seed)
    cut = st.integers(0, len(text)).map(lambda n: text[:n])
    spliced = st.tuples(st.integers(0, len(text)), st.text(alphabet="[]{}=\"'.,#\n\\ ax1", max_size=6)).map(
        lambda t: text[:t[0]] + t[1] + text[t[0]:])
    return st.text(max_size=200) | cut | spliced


# tmp_path is shared by the examples on purpose: each writes its own file over the last one.
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ----- kvctl serve --config ---------------------------------------------------------------------------------


def _serve_loads(path: Path) -> None:
    """What loaded is usable: the daemon declares every model and registers every worker without a second look."""
    declared = load(path)
    fleet = Fleet(block_size=16, seed=0)
    for spec in declared.models:
        assert isinstance(spec.name, str) and spec.name
        fleet.add_model(spec.name, block_size=spec.block_size)
        if spec.thresholds:
            fleet.thresholds.set(spec.name, **spec.thresholds)
    for worker in declared.workers:
        assert type(worker.worker_id) is int and 0 <= worker.worker_id < 2**64
        assert type(worker.dp_rank) is int and 0 <= worker.dp_rank < 2**32
        assert isinstance(worker.model, str) and worker.model and isinstance(worker.topic, str)
        assert worker.endpoint is not None
        check_endpoint(worker.endpoint)
        assert worker.replay_endpoint is None or check_endpoint(worker.replay_endpoint)
        fleet.register(worker)


@SETTINGS
@given(one_wrong(SERVE))
@example(('models = [{name = 5}]\n', {"name"}))
@example(('models = [{name = "m", overlap_score_weight = ' + "9" * 400 + "}]\n", {"overlap_score_weight"}))
@example(('models = [{name = "m", overlap_score_weight = -1}]\n', {"overlap_score_weight"}))  # an alias named
@example(('workers = [{worker_id = "1", endpoint = "tcp://h:1"}]\n', {"worker_id"}))
@example(('workers = [{worker_id = 1, endpoint = "garbage"}]\n', {"endpoint"}))
@example(("models = 5\n", {"models"}))
def test_serve_config_with_one_wrong_value_names_it(tmp_path: Path, case: tuple[str, set[str] | None]) -> None:
    text, names = case
    path = tmp_path / "serve.toml"
    path.write_text(text)
    try:
        _serve_loads(path)
    except ConfigError as exc:
        assert names is None or any(name in str(exc) for name in names), (str(exc), names)


@SETTINGS
@given(_garbled(SERVE).map(str.encode) | st.binary(max_size=100))
@example(b"\xff\xfe[[models]]")
def test_serve_config_text_fails_only_as_config_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "serve.toml"
    path.write_bytes(data)
    try:
        _serve_loads(path)
    except ConfigError as exc:
        assert str(path) in str(exc)


# ----- the client's contexts file ---------------------------------------------------------------------------


def _client_resolves(path: Path) -> None:
    settings = resolve({}, env={}, file=ConfigFile.load(path))
    assert isinstance(settings.server, str)
    assert settings.token is None or isinstance(settings.token, str)
    assert settings.prometheus is None or isinstance(settings.prometheus, str)
    assert 0 < settings.timeout < math.inf


@SETTINGS
@given(one_wrong(CLIENT))
@example(("current-context = [1]\n", {"current-context"}))
@example(('current-context = "prod"\ncontexts = {prod = {timeout = ' + "9" * 400 + "}}\n", {"timeout"}))
@example(('current-context = "prod"\ncontexts = {prod = {timeout = nan}}\n', {"timeout"}))
@example(('current-context = "prod"\ncontexts = {prod = {token = 5}}\n', {"token"}))
@example(('current-context = "prod"\ncontexts = {prod = {server = "http://x", "\\u001f" = 1}}\n', {"\x1f"}))
def test_client_config_with_one_wrong_value_names_it(tmp_path: Path, case: tuple[str, set[str] | None]) -> None:
    text, names = case
    path = tmp_path / "config.toml"
    path.write_text(text)
    try:
        _client_resolves(path)
    except ConfigError as exc:
        message = exc.message + (exc.hint or "")
        if names is not None and "contexts" in names and "current-context" in message:
            return  # contexts replaced by a table without the current one: the dangling name is what is wrong
        # names are quoted the way repr does (a control character escaped), so the terminal shows them
        assert names is None or any(name in message or repr(name)[1:-1] in message for name in names), (message, names)


@SETTINGS
@given(_garbled(CLIENT).map(str.encode) | st.binary(max_size=100))
@example(b"current-context = \xff")
def test_client_config_text_fails_only_as_config_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(data)
    try:
        _client_resolves(path)
    except ConfigError as exc:
        assert exc.message


# ----- kvctl serve --worker ID[:DP]=ENDPOINT[,replay=…][,model=…][,topic=…] --------------------------------

_ENDPOINTS = st.sampled_from(["tcp://127.0.0.1:5557", "tcp://*:5557", "garbage", "ipc://", "tcp://h:0", ""]) | st.text(
    max_size=20)
WORKER_FLAGS = st.one_of(
    st.text(max_size=60),
    st.builds(lambda wid, dp, endpoint, opts: f"{wid}{dp}={endpoint}{opts}",
              st.sampled_from(["1", "0", "18446744073709551616", "9" * 5000, "x", "١"]),
              st.sampled_from(["", ":0", ":4294967296", ":x"]), _ENDPOINTS,
              st.sampled_from(["", ",replay=tcp://127.0.0.1:5600", ",replay=garbage", ",model=m", ",bogus=1"])),
)


@settings(max_examples=300, deadline=None)
@given(WORKER_FLAGS)
@example("1=garbage")
@example("1=tcp://127.0.0.1:5557,replay=")
@example("9" * 5000 + "=tcp://127.0.0.1:5557")
def test_worker_flag_is_refused_as_a_usage_error_or_usable(flag: str) -> None:
    try:
        info = parse_engine(flag)
    except UsageError as exc:
        assert exc.message.startswith("--worker")
        return
    assert 0 <= info.worker_id < 2**64 and 0 <= info.dp_rank < 2**32
    assert info.endpoint is not None and check_endpoint(info.endpoint)
    assert info.replay_endpoint is None or check_endpoint(info.replay_endpoint)
