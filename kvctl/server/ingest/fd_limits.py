"""How many engines a router can follow: its file descriptors, and ZMQ's sockets per context.

A ZMQ context makes at most 1023 sockets unless told otherwise, whatever the process's file limit: past
~1022 engine endpoints the decode process once died of `Too many open files` and 278 streams stopped,
while every registration had been answered 201. So the router raises its soft file limit to the hard one,
sizes its contexts' socket limit to match, and refuses (409) an engine past `--max-engines`, whose default
leaves room for everything else the process opens.
"""

from __future__ import annotations

import logging
import resource
from typing import Any, TypeVar

import zmq

log = logging.getLogger("kvctl.serve")

FDS_PER_ENGINE = 6
"""An engine's SUB and replay DEALER, each a TCP connection and a ZMQ mailbox (an eventfd), and the SUB's monitor
(two mailboxes: libzmq's end and ours, `kvctl.zmq_limits`): all in the router when it decodes inline, or once its
decode process is gone."""
SOCKETS_PER_ENGINE = 4
"""ZMQ sockets of an engine: its SUB, its DEALER and the SUB's monitor pair."""

RESERVED_FDS = 512
"""Descriptors kept for the rest of the router (HTTP connections, snapshots, the decode process's pipes, NATS,
logs, ZMQ's own threads): this many, or a quarter of a lower limit."""

ZMQ_DEFAULT_SOCKETS = 1023

C = TypeVar("C", bound="zmq.Context[Any]")


def raise_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one where allowed; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:  # a hard limit the kernel caps lower (nr_open): keep the soft one
            log.info("cannot raise the file limit from %d to %d: %s", soft, hard, exc)
    return file_limit()


def file_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def sized(context: C) -> C:
    """`context` allowed as many sockets as the process may open files (ZMQ's default is 1023); call it before
    the context's first socket, which fixes the size."""
    wanted = min(max(file_limit(), ZMQ_DEFAULT_SOCKETS), context.get(zmq.SOCKET_LIMIT))
    context.set(zmq.MAX_SOCKETS, wanted)
    return context


def default_max_engines(files: int, sockets: int) -> int:
    """Engines a router may follow with `files` descriptors and a context of `sockets` sockets."""
    return max(1, min((files - min(RESERVED_FDS, files // 4)) // FDS_PER_ENGINE, sockets // SOCKETS_PER_ENGINE - 1))
