"""How to reach a NATS server: URL, credentials, TLS. Shared by `serve --nats` and the CLI's NATS commands.

`NatsConnection` is plain configuration: `connect_kwargs` turns it into nats-py's `connect()` arguments.
Secrets are kept out of `repr`, so a logged or printed connection never shows them. `connect` is how every
command opens one (the router's event plane keeps its own, which retries for ever by design).
"""

from __future__ import annotations

import ssl
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvctl.errors import Unreachable

if TYPE_CHECKING:
    import nats

FIRST_RETRY_S = 0.1  # between the two attempts of a first connect
RECONNECT_WAIT_S = 2.0  # between attempts to get a dropped connection back (nats-py's default)
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
            context = ssl.create_default_context(cafile=str(self.tls_ca) if self.tls_ca else None)
            if self.tls_cert:
                context.load_cert_chain(str(self.tls_cert), str(self.tls_key) if self.tls_key else None)
            kwargs["tls"] = context
        return kwargs


async def connect(conn: NatsConnection, *, follow: bool = False) -> nats.NATS:
    """Two quick attempts per server (nats-py's fewest; each bounded by the connection's timeout), then
    `Unreachable`: one line, exit 3.

    nats-py would otherwise try an unreachable server 60 times 2 s apart (for ever with reconnects
    unlimited), reporting each attempt through its logger with a traceback; its error callback is silenced
    here (the last failure is what is raised). `follow`: a tap that outlives a server restart, reconnecting
    for ever once connected."""
    import nats

    failures: deque[Exception] = deque(maxlen=1)  # the last one: the callback outlives the connect

    async def keep(exc: Exception) -> None:
        failures.append(exc)

    try:
        nc = await nats.connect(conn.url, allow_reconnect=False, max_reconnect_attempts=1,
                                reconnect_time_wait=FIRST_RETRY_S, error_cb=keep, **conn.connect_kwargs())
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        cause = failures[-1] if failures else exc  # "no servers available" says less than why
        raise Unreachable(f"cannot reach NATS at {conn.shown_url}: {cause or type(cause).__name__}",
                          hint=UNREACHABLE_HINT) from None
    if follow:  # nats-py reads these when the connection drops, not only when it is opened
        nc.options.update(allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=RECONNECT_WAIT_S)
    return nc


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
