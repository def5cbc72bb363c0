"""`kvctl serve --config FILE`: models and workers declared in TOML.

    [[models]]
    name = "llama"                       # required
    block_size = 32                      # default: --block-size
    overlap_score_weight = 1.0           # router knobs, default: the flags
    temperature = 0.0
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

Unknown keys are errors (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvctl.core.router.busy import THRESHOLD_FIELDS, Thresholds
from kvctl.core.router.scoring import RouterConfig
from kvctl.server.state import WorkerInfo

_MODEL_KEYS = {"name", "block_size", "overlap_score_weight", "temperature", *THRESHOLD_FIELDS}
_WORKER_KEYS = {"worker_id", "dp_rank", "endpoint", "replay_endpoint", "model", "topic"}


class ConfigFileError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    block_size: int | None = None
    overlap_score_weight: float | None = None
    temperature: float | None = None
    thresholds: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ServeFile:
    models: list[ModelSpec]
    workers: list[WorkerInfo]


def _table(item: Any, where: str, allowed: set[str], required: set[str]) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise ConfigFileError(f"{where} must be a table")
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise ConfigFileError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(allowed))})")
    missing = sorted(required - set(item))
    if missing:
        raise ConfigFileError(f"{where}: missing {missing[0]!r}")
    return item


def load(path: Path) -> ServeFile:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigFileError(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{path}: {exc}") from None
    unknown = sorted(set(data) - {"models", "workers"})
    if unknown:
        raise ConfigFileError(f"{path}: unknown section {unknown[0]!r} (known: models, workers)")
    models = []
    for i, raw in enumerate(data.get("models", [])):
        where = f"{path}: models[{i}]"
        m = _table(raw, where, _MODEL_KEYS, {"name"})
        spec = ModelSpec(m["name"], m.get("block_size"), m.get("overlap_score_weight"), m.get("temperature"),
                         {k: m[k] for k in THRESHOLD_FIELDS if k in m})
        if spec.block_size is not None and not (type(spec.block_size) is int and spec.block_size > 0):
            raise ConfigFileError(f"{where}: block_size must be a positive integer, got {spec.block_size!r}")
        try:  # the same checks as the flags and the HTTP API
            Thresholds(**spec.thresholds)
            RouterConfig().override(overlap_score_weight=spec.overlap_score_weight, temperature=spec.temperature)
        except (ValueError, TypeError) as exc:
            raise ConfigFileError(f"{where} ({spec.name}): {exc}") from None
        models.append(spec)
    workers = []
    for i, raw in enumerate(data.get("workers", [])):
        w = _table(raw, f"{path}: workers[{i}]", _WORKER_KEYS, {"worker_id", "endpoint"})
        workers.append(WorkerInfo(w["worker_id"], w.get("dp_rank", 0), w.get("model", "default"),
                                  endpoint=w["endpoint"], replay_endpoint=w.get("replay_endpoint"),
                                  topic=w.get("topic", "")))
    return ServeFile(models, workers)
