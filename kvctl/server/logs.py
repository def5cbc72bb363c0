"""Logging for the daemon: human text, or one JSON object per line for log pipelines."""

from __future__ import annotations

import json
import logging
import sys
from enum import StrEnum

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class LogLevel(StrEnum):
    """`kvctl serve --log-level`: an enum, so `--help` lists the levels and a typo is refused at once."""

    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"
    critical = "critical"


class LogFormat(StrEnum):
    """`kvctl serve --log-format`: human text, or one JSON object per line."""

    text = "text"
    json = "json"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                 "msg": record.getMessage()}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure(level: LogLevel, fmt: LogFormat) -> None:
    """Logs go to stderr: stdout carries only the URL the daemon listens on."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == LogFormat.json else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
