"""systemd's service notification protocol (sd_notify(3)), spoken directly: one datagram per message.

Under `Type=notify` systemd names a datagram socket in NOTIFY_SOCKET and counts the service as started only
once it sends `READY=1`, so units ordered after the router start when it answers, not when its process
exists; `STOPPING=1` says a stop is under way (a drain and the final snapshot), not a hang. With
WATCHDOG_USEC set, `WATCHDOG=1` every half of it shows that the event loop still turns: a loop that stops
gets the service restarted. Without NOTIFY_SOCKET every message is dropped, so the daemon sends them
unconditionally. The protocol is a few lines, hence no libsystemd binding and no new dependency.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import MutableMapping

log = logging.getLogger("kvctl.serve")

_ENVIRONMENT = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def socket_address(value: str) -> str | None:
    """NOTIFY_SOCKET as an AF_UNIX address: a path, or `@name` for the abstract namespace (Linux writes it
    with a leading NUL). None for what this protocol cannot reach (systemd's `vsock:` form, a relative path)."""
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    return value if value.startswith("/") else None


class Notifier:
    """Where this process reports its state to systemd; every method is a no-op when none is listening."""

    def __init__(self, address: str | None, watchdog_s: float | None = None) -> None:
        self.address = address
        self.watchdog_s = watchdog_s  # systemd's watchdog timeout; None: no watchdog asked for this process
        self._warned = False

    @classmethod
    def from_environment(cls, environ: MutableMapping[str, str] = os.environ) -> Notifier:
        """The notifier systemd's variables describe, which are then removed: children (the decode process)
        must not report for the service, and systemd refuses their messages under `NotifyAccess=main` anyway."""
        value, usec, pid = (environ.pop(name, None) for name in _ENVIRONMENT)
        address = socket_address(value) if value else None
        if value and address is None:
            log.warning("NOTIFY_SOCKET=%s is no AF_UNIX socket: systemd will not hear that the router is ready",
                        value)
        ours = pid is None or pid == str(os.getpid())
        watchdog_s = int(usec) / 1e6 if usec and usec.isdigit() and int(usec) > 0 and ours else None
        return cls(address, watchdog_s if address is not None else None)

    def ready(self, status: str) -> None:
        self.send(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        """A line `systemctl status` shows beside the unit: how far a restore is, before READY=1."""
        self.send(f"STATUS={status}")

    def stopping(self, status: str) -> None:
        self.send(f"STOPPING=1\nSTATUS={status}")

    def send(self, message: str) -> None:
        """One datagram; a failure is logged once and never stops the router (systemd then times it out)."""
        if self.address is None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message.encode(), self.address)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("cannot notify systemd at NOTIFY_SOCKET: %s", exc)

    async def keep_alive(self) -> None:
        """`WATCHDOG=1` every half of the watchdog timeout, from the event loop itself, until cancelled."""
        if self.watchdog_s is None:
            return
        while True:
            self.send("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_s / 2)
