"""The engine endpoints a router connects to, checked where they are given (HTTP, config file) rather than where
they are used: libzmq only refuses a bad one inside the stream's task, after the registration had succeeded,
and the stream was then gone with nothing but a traceback in the log."""

from __future__ import annotations

import re

__all__ = ["check_endpoint"]

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9_-]*[A-Za-z0-9])?"
_HOST = rf"(?:\[[0-9A-Fa-f:.]+\]|{_LABEL}(?:\.{_LABEL})*)"
_TCP = re.compile(rf"tcp://(?:{_HOST};)?{_HOST}:(?P<port>[0-9]{{1,5}})")  # libzmq's [SOURCE;]HOST:PORT
_IPC_PATH_MAX = 107  # sun_path holds 108 bytes, the terminating NUL included
_WANTED = "tcp://HOST:PORT, ipc://PATH or inproc://NAME"


def check_endpoint(endpoint: str) -> str:
    """`endpoint` when a ZMQ socket can connect to it; ValueError saying what is expected otherwise."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme == "tcp" and (m := _TCP.fullmatch(endpoint)) is not None and 0 < int(m["port"]) <= 65535:
        return endpoint
    if sep and scheme in ("ipc", "inproc") and rest.lstrip("@") and rest.isprintable() and " " not in rest:
        if scheme == "ipc" and len(rest.encode()) > _IPC_PATH_MAX:
            raise ValueError(f"ipc path of {len(rest.encode())} bytes is over the {_IPC_PATH_MAX}-byte limit")
        return endpoint
    shown = endpoint if len(endpoint) <= 80 else endpoint[:77] + "..."
    raise ValueError(f"not an engine endpoint: {shown!r} (expected {_WANTED})")
