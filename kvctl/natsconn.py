"""How to reach a NATS server: URL, credentials, TLS. Shared by `serve --nats` and `events publish`.

Plain configuration (no I/O): `connect_kwargs` turns it into nats-py's `connect()` arguments. Secrets
are kept out of `repr`, so a logged or printed connection never shows them.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
