"""How to reach a NATS server (URL, credentials, TLS), and the one way kvctl connects to one.

`NatsConnection` is plain configuration: `connect_kwargs` turns it into nats-py's `connect()` arguments.
Secrets are kept out of `repr`, so a logged or printed connection never shows them. `connect` is how every
part of kvctl opens a connection (the CLI's commands, `serve --nats`, `mock --format dynamo-nats`): a failure
is `Unreachable` in one line, never nats-py's traceback; a long-lived caller says how it wants a lost
server got back (`Reconnect`) instead of configuring nats-py itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvctl.errors import Unreachable

if TYPE_CHECKING:
    import nats
    from nats.aio.client import Server

FIRST_RETRY_S = 0.1  # between the two attempts of a first connect
PENDING_MSGS = 512 * 1024
"""Messages nats-py holds for a subscription whose reader is behind (its own default); past it, or
`PENDING_BYTES`, it drops them and says so (`SlowConsumerError`)."""
PENDING_BYTES = 128 * 1024 * 1024
"""Bytes of them (nats-py's default): a burst of a hundred 0.9 MB batches fits, and a reader's memory may grow by as
much while it catches up."""
UNREACHABLE_HINT = "is nats-server running there, and is --nats right?"


@dataclass(frozen=True, slots=True)
class NatsConnection:
    url: str
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds: Path | None = None  # a .creds file: JWT + nkey seed
    nkey: Path | None = None  # an nkey seed file
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    connect_timeout_s: float = 5.0

    @property
    def shown_url(self) -> str:
        """The URL to log and show: credentials written into it (nats://user:PASSWORD@ or nats://TOKEN@)
        masked."""
        return redact_url(self.url)

    def files(self) -> dict[str, Path]:
        """The files this connection reads, by the option that named them (checked before connecting)."""
        named = {"--nats-creds": self.creds, "--nats-nkey": self.nkey, "--nats-tls-ca": self.tls_ca,
                 "--nats-tls-cert": self.tls_cert, "--nats-tls-key": self.tls_key}
        return {flag: path for flag, path in named.items() if path is not None}

    def connect_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"connect_timeout": self.connect_timeout_s}
        if self.user is not None:
            kwargs.update(user=self.user, password=self.password)
        if self.token is not None:
            kwargs["token"] = self.token
        if self.creds is not None:
            kwargs["user_credentials"] = str(self.creds)
        if self.nkey is not None:
            kwargs["nkeys_seed"] = str(self.nkey)
        if self.tls_ca or self.tls_cert:
            import ssl  # 40 ms to load: only for a TLS connection, not every command that offers --nats

            context = ssl.create_default_context(cafile=str(self.tls_ca) if self.tls_ca else None)
            if self.tls_cert:
                context.load_cert_chain(str(self.tls_cert), str(self.tls_key) if self.tls_key else None)
            kwargs["tls"] = context
        return kwargs


@dataclass(frozen=True, slots=True, kw_only=True)
class Reconnect:
    """How a long-lived connection gets its server back once it was connected: for ever, the first try after
    `first_s`, each next one after twice the wait of the one before, up to `max_s` (equal: a steady pace)."""

    first_s: float
    max_s: float

    def delay(self, tries: int) -> float:
        """The wait before try number `tries` (from 0) since the connection was lost or last refused."""
        return min(self.first_s * 2 ** min(tries, 64), self.max_s)

    def choose(self, servers: list[Server], _info: dict[str, Any]) -> tuple[Server, float]:
        """nats-py's reconnect hook: the first server it offers, after this policy's wait for it."""
        return servers[0], self.delay(servers[0].reconnects)


ErrorCallback = Callable[[Exception], Awaitable[None]]
Callback = Callable[[], Awaitable[None]]


async def connect(conn: NatsConnection, *, reconnect: Reconnect | None = None, name: str | None = None,
                  on_error: ErrorCallback | None = None, on_disconnected: Callback | None = None,
                  on_reconnected: Callback | None = None, on_closed: Callback | None = None) -> nats.NATS:
    """Two quick attempts per server (nats-py's fewest; each bounded by the connection's timeout), then
    `Unreachable`: one line, exit 3.

    nats-py would otherwise try an unreachable server 60 times 2 s apart (for ever with reconnects
    unlimited), reporting each attempt through its logger with a traceback: here the attempts' errors are
    kept (the last one is what is raised) and only later ones reach `on_error` (none: dropped). `reconnect`:
    a connection that outlives a server restart, getting it back by that policy once connected; the
    callbacks are nats-py's, for a caller that shows the connection's state."""
    import nats

    failures: deque[Exception] = deque(maxlen=1)  # the last one: the callback outlives the connect
    connected = False

    async def error(exc: Exception) -> None:
        if not connected:
            failures.append(exc)
        elif on_error is not None:
            await on_error(exc)

    nc = nats.NATS()
    try:
        await nc.connect(conn.url, name=name, allow_reconnect=False, max_reconnect_attempts=1,
                         reconnect_time_wait=FIRST_RETRY_S,  # type: ignore[arg-type]  # seconds: nats-py sleeps them
                         error_cb=error, disconnected_cb=on_disconnected, reconnected_cb=on_reconnected,
                         closed_cb=on_closed, reconnect_to_server_handler=reconnect.choose if reconnect else None,
                         **conn.connect_kwargs())
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        if nc._transport is not None:  # a refusal (a wrong password, an untrusted certificate) leaves it open, and
            nc._transport.close()  # nats-py's close() would wait for ever on one that failed its TLS handshake
        cause = failures[-1] if failures else exc  # "no servers available" says less than why
        raise unreachable(conn, str(cause) or type(cause).__name__) from None
    connected = True
    if reconnect is not None:  # nats-py reads these when the connection drops, not only when it is opened
        nc.options.update(allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=reconnect.first_s)
    return nc


def server_id(nc: nats.NATS) -> str | None:
    """The id of the server `nc` is connected to, from its INFO: each nats-server start draws a new one, so the
    same id after a reconnect means the server closed the connection and kept running (a slow consumer)."""
    found = nc._server_info.get("server_id")  # nats-py keeps the INFO, with no accessor for the id
    return found if isinstance(found, str) else None


def unreachable(conn: NatsConnection, why: str) -> Unreachable:
    """The one line every NATS connection that failed ends in, saying `why`."""
    return Unreachable(f"cannot reach NATS at {conn.shown_url}: {why}", hint=UNREACHABLE_HINT)


def redact_url(url: str) -> str:
    """`url` with the secret of its userinfo replaced by ***: the password of user:password, or a lone
    token (nats://TOKEN@host). Several comma-separated URLs (a NATS server list) are each masked."""
    return ",".join(_redact_one(part) for part in url.split(","))


def _redact_one(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, tail = rest.partition("/")
    userinfo, at, host = authority.rpartition("@")
    if not at:
        return url
    user, colon, _ = userinfo.partition(":")
    masked = f"{user}:***" if colon else "***"
    return f"{scheme}://{masked}@{host}{slash}{tail}"
