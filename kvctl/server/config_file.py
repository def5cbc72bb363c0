"""`kvctl serve --config FILE`: models and workers declared in TOML.

    [[models]]
    name = "llama"                       # required
    block_size = 32                      # default: --block-size
    overlap_score_credit = 1.0           # router knobs by their Dynamo names (docs/contract.md), default: the
    prefill_load_scale = 1.0             # flags; also overlap_score_credit_decay, decode_active_request_weight,
    host_cache_hit_weight = 0.75         # disk_cache_hit_weight, router_temperature, track_prefill_tokens, and
    router_temperature = 0.0             # the legacy overlap_score_weight and temperature
    active_decode_blocks_threshold = 0.9 # busy thresholds, default: the flags
    active_prefill_tokens_threshold = 20000
    active_prefill_tokens_threshold_frac = 4.0

    [[workers]]
    worker_id = 1                        # required
    dp_rank = 0
    endpoint = "tcp://10.0.0.1:5557"     # required
    replay_endpoint = "tcp://10.0.0.1:5600"
    model = "llama"
    topic = ""

Unknown keys are errors (a typo must not silently fall back to a default): a `ConfigError`, exit 2. `render`
writes the format (`kvctl mock --config-out`); docs/configuration.md documents it in full.
"""

from __future__ import annotations

import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvctl.config.writer import toml_string
from kvctl.core.names import DEFAULT_MODEL
from kvctl.core.router.busy import THRESHOLD_FIELDS, Thresholds
from kvctl.core.router.scoring import KNOBS, RouterConfig
from kvctl.errors import ConfigError
from kvctl.server.ingest.endpoint import check_endpoint
from kvctl.server.worker_info import WorkerInfo

_ROUTER_KEYS = (*KNOBS, "overlap_score_weight", "temperature")
_MODEL_KEYS = {"name", "block_size", *_ROUTER_KEYS, *THRESHOLD_FIELDS}
_WORKER_KEYS = {"worker_id", "dp_rank", "endpoint", "replay_endpoint", "model", "topic", "engine_url"}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    block_size: int | None = None
    router: dict[str, Any] = field(default_factory=dict)  # `RouterConfig.override` arguments
    thresholds: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ServeFile:
    models: list[ModelSpec]
    workers: list[WorkerInfo]
    # Each worker's HTTP API (generate, /metrics), where the file says: not followed by the router, but the same
    # file then drives a load (`kvctl mock load --engines-file`), so the fleet is described once.
    engine_urls: dict[tuple[int, int], str] = field(default_factory=dict)


def _table(item: Any, where: str, allowed: set[str], required: set[str]) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise ConfigError(f"{where} must be a table")
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(allowed))})")
    missing = sorted(required - set(item))
    if missing:
        raise ConfigError(f"{where}: missing {missing[0]!r}")
    return item


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check(where: str, key: str, value: Any, ok: bool, wanted: str) -> Any:
    if not ok:
        raise ConfigError(f"{where}: {key} must be {wanted}, got {_shown(value)}")
    return value


def _number(value: Any) -> bool:
    """An int or float TOML value that a float can hold (not a bool, which Python counts as an int)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and abs(value) <= sys.float_info.max


def _uint(value: Any, bits: int) -> bool:
    return type(value) is int and 0 <= value < 1 << bits


def _name(value: Any) -> bool:
    return isinstance(value, str) and value != ""


def _url(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(("http://", "https://"))


def _array(data: dict[str, Any], key: str, path: Path) -> list[Any]:
    return _check(str(path), key, data.get(key, []), isinstance(data.get(key, []), list),
                  f"an array of tables ([[{key}]])")


def load(path: Path) -> ServeFile:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    unknown = sorted(set(data) - {"models", "workers"})
    if unknown:
        raise ConfigError(f"{path}: unknown section {unknown[0]!r} (known: models, workers)")
    models = []
    for i, raw in enumerate(_array(data, "models", path)):
        where = f"{path}: models[{i}]"
        m = _table(raw, where, _MODEL_KEYS, {"name"})
        _check(where, "name", m["name"], _name(m["name"]), "a non-empty string")
        spec = ModelSpec(m["name"], m.get("block_size"), {k: m[k] for k in _ROUTER_KEYS if k in m},
                         {k: m[k] for k in THRESHOLD_FIELDS if k in m})
        if spec.block_size is not None and not (type(spec.block_size) is int and spec.block_size > 0):
            raise ConfigError(f"{where}: block_size must be a positive integer, got {_shown(spec.block_size)}")
        for key, value in spec.router.items():
            if key == "track_prefill_tokens":
                _check(where, key, value, isinstance(value, bool), "true or false")
            else:
                _check(where, key, value, _number(value), "a number")
        try:  # the same checks as the flags and the HTTP API
            Thresholds(**spec.thresholds)
            RouterConfig().override(**spec.router)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{where} ({spec.name}): {exc}") from None
        models.append(spec)
    workers = []
    engine_urls = {}
    for i, raw in enumerate(_array(data, "workers", path)):
        where = f"{path}: workers[{i}]"
        w = _table(raw, where, _WORKER_KEYS, {"worker_id", "endpoint"})
        _check(where, "worker_id", w["worker_id"], _uint(w["worker_id"], 64), "an integer in [0, 2^64)")
        _check(where, "dp_rank", w.get("dp_rank", 0), _uint(w.get("dp_rank", 0), 32), "an integer in [0, 2^32)")
        model = w.get("model", DEFAULT_MODEL)
        _check(where, "model", model, _name(model), "a non-empty string")
        _check(where, "topic", w.get("topic", ""), isinstance(w.get("topic", ""), str), "a string")
        for key in ("endpoint", "replay_endpoint"):
            if key in w:
                _check(where, key, w[key], isinstance(w[key], str), "a string")
                try:
                    check_endpoint(w[key])
                except ValueError as exc:
                    raise ConfigError(f"{where}: {key}: {exc}") from None
        if "engine_url" in w:
            _check(where, "engine_url", w["engine_url"], _url(w["engine_url"]), "an http:// or https:// URL")
            engine_urls[(w["worker_id"], w.get("dp_rank", 0))] = w["engine_url"]
        workers.append(WorkerInfo(w["worker_id"], w.get("dp_rank", 0), model,
                                  endpoint=w["endpoint"], replay_endpoint=w.get("replay_endpoint"),
                                  topic=w.get("topic", "")))
    return ServeFile(models, workers, engine_urls)


def render(file: ServeFile) -> str:
    """The TOML text that `load` reads back as `file`'s models and workers."""
    lines: list[str] = []
    for m in file.models:
        fields = {"name": m.name, "block_size": m.block_size, **m.router, **m.thresholds}
        lines += ["[[models]]", *_assignments(fields), ""]
    for w in file.workers:
        fields = {"worker_id": w.worker_id, "dp_rank": w.dp_rank, "model": w.model, "endpoint": w.endpoint,
                  "replay_endpoint": w.replay_endpoint, "topic": w.topic or None,
                  "engine_url": file.engine_urls.get(w.key)}
        lines += ["[[workers]]", *_assignments(fields), ""]
    return "\n".join(lines)


def _assignments(fields: dict[str, Any]) -> list[str]:
    return [f"{key} = {_toml(value)}" for key, value in fields.items() if value is not None]


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return toml_string(value)
    return repr(value)
