"""Logging for the daemon: human text, or one JSON object per line for log pipelines."""

from __future__ import annotations

import json
import logging
import sys

from kvctl.server.serve_choices import LogFormat, LogLevel


def error_text(exc: BaseException) -> str:
    """How an error shows in status and logs: its type and message (nats-py's messages alone can be empty)."""
    return f"{type(exc).__name__}: {exc}"


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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
