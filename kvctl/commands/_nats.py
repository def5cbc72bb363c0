"""The NATS options every command that speaks to an event plane takes, declared once."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from kvctl.errors import UsageError
from kvctl.nats.connection import NatsConnection

PANEL = "NATS event plane (Dynamo)"

NamespaceOpt = Annotated[str, typer.Option("--namespace", envvar="KVCTL_NAMESPACE", rich_help_panel=PANEL,
                                           help="Dynamo namespace.")]
ComponentOpt = Annotated[str, typer.Option("--component", envvar="KVCTL_COMPONENT", rich_help_panel=PANEL,
                                           help="The workers' Dynamo component.")]
EndpointOpt = Annotated[str, typer.Option("--endpoint", envvar="KVCTL_ENDPOINT", rich_help_panel=PANEL,
                                          help="The workers' Dynamo endpoint.")]
ComponentScopeOpt = Annotated[str | None, typer.Option(
    "--component", envvar="KVCTL_COMPONENT", show_default=False, rich_help_panel=PANEL,
    help="Follow only this Dynamo component (default: every component of the namespace).")]
EndpointScopeOpt = Annotated[str | None, typer.Option(
    "--endpoint", envvar="KVCTL_ENDPOINT", show_default=False, rich_help_panel=PANEL,
    help="Follow only this Dynamo endpoint (default: every endpoint).")]
UserOpt = Annotated[str | None, typer.Option("--nats-user", envvar="KVCTL_NATS_USER", show_default=False,
                                             rich_help_panel=PANEL)]
PasswordOpt = Annotated[str | None, typer.Option("--nats-password", envvar="KVCTL_NATS_PASSWORD",
                                                 show_default=False, rich_help_panel=PANEL)]
TokenOpt = Annotated[str | None, typer.Option("--nats-token", envvar="KVCTL_NATS_TOKEN", show_default=False,
                                              rich_help_panel=PANEL)]
CredsOpt = Annotated[Path | None, typer.Option("--nats-creds", envvar="KVCTL_NATS_CREDS", show_default=False,
                                               rich_help_panel=PANEL, help="A .creds file (JWT + nkey).")]
NkeyOpt = Annotated[Path | None, typer.Option("--nats-nkey", envvar="KVCTL_NATS_NKEY", show_default=False,
                                              rich_help_panel=PANEL, help="An nkey seed file.")]
TlsCaOpt = Annotated[Path | None, typer.Option("--nats-tls-ca", envvar="KVCTL_NATS_TLS_CA", show_default=False,
                                               rich_help_panel=PANEL)]
TlsCertOpt = Annotated[Path | None, typer.Option("--nats-tls-cert", envvar="KVCTL_NATS_TLS_CERT",
                                                 show_default=False, rich_help_panel=PANEL)]
TlsKeyOpt = Annotated[Path | None, typer.Option("--nats-tls-key", envvar="KVCTL_NATS_TLS_KEY", show_default=False,
                                                rich_help_panel=PANEL)]
ConnectTimeoutOpt = Annotated[float, typer.Option(
    "--nats-connect-timeout", envvar="KVCTL_NATS_CONNECT_TIMEOUT", rich_help_panel=PANEL,
    help="Seconds per connection attempt.")]


def connection(url: str, user: str | None, password: str | None, token: str | None, creds: Path | None,
               nkey: Path | None, tls_ca: Path | None, tls_cert: Path | None, tls_key: Path | None,
               connect_timeout: float) -> NatsConnection:
    """The connection the options describe; a named file that is not there is a usage error, before any I/O."""
    if not url.startswith(("nats://", "tls://", "ws://", "wss://")):
        raise UsageError(f"--nats wants a URL like nats://HOST:4222, got {url!r}")
    if not connect_timeout > 0:
        raise UsageError(f"--nats-connect-timeout must be > 0 seconds, got {connect_timeout}")
    conn = NatsConnection(url, user, password, token, creds, nkey, tls_ca, tls_cert, tls_key, connect_timeout)
    for flag, path in conn.files().items():
        if not path.is_file():
            raise UsageError(f"{flag}: no such file {str(path)!r}")
    if creds is not None:
        _check_creds(creds)
    if nkey is not None:
        _check_seed("--nats-nkey", nkey, _read(nkey, "--nats-nkey").strip())
    return conn


def _read(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{flag}: cannot read {str(path)!r}: {exc.strerror}") from None


def _check_creds(path: Path) -> None:
    """A .creds file as nats-py reads it: the line after each BEGIN marker. nats-py does not check: a file
    without the JWT loops forever inside the event loop, one without the seed raises a TypeError."""
    lines = _read(path, "--nats-creds").splitlines()

    def after(marker: bytes) -> bytes:
        at = next((n for n, line in enumerate(lines) if marker in line), None)
        return lines[at + 1].strip() if at is not None and at + 1 < len(lines) else b""

    if after(b"BEGIN NATS USER JWT").count(b".") != 2:
        raise UsageError(f"--nats-creds: {str(path)!r} holds no NATS user JWT",
                         hint="a .creds file has a -----BEGIN NATS USER JWT----- and a -----BEGIN USER NKEY "
                              "SEED----- section (nsc generate creds); a lone seed goes to --nats-nkey")
    _check_seed("--nats-creds", path, after(b"BEGIN USER NKEY SEED"))


def _check_seed(flag: str, path: Path, seed: bytes) -> None:
    import nkeys

    try:
        nkeys.from_seed(bytearray(seed)).wipe()
    except (nkeys.NkeysError, ValueError):
        raise UsageError(f"{flag}: {str(path)!r} holds no valid nkey seed") from None


NatsAuth = Callable[[str], NatsConnection]
"""A URL -> the connection to it with the credentials the command was given."""

_CREDENTIALS: tuple[tuple[str, Any, Any], ...] = (
    ("nats_user", UserOpt, None), ("nats_password", PasswordOpt, None), ("nats_token", TokenOpt, None),
    ("nats_creds", CredsOpt, None), ("nats_nkey", NkeyOpt, None), ("nats_tls_ca", TlsCaOpt, None),
    ("nats_tls_cert", TlsCertOpt, None), ("nats_tls_key", TlsKeyOpt, None),
    ("nats_connect_timeout", ConnectTimeoutOpt, 5.0),
)


def with_nats_credentials(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give a command the --nats-* credential and TLS options, and hand it `nats_auth` (a `NatsAuth`) instead.

    Declared here once: every command that reaches NATS takes the same nine options, checked the same way.
    """
    signature = inspect.signature(command, eval_str=True)  # real Annotated[...] objects, for typer to read
    kept = [p for p in signature.parameters.values() if p.name != "nats_auth"]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
             for name, annotation, default in _CREDENTIALS]

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        given = [kwargs.pop(name) for name, _, _ in _CREDENTIALS]
        return command(*args, nats_auth=lambda url: connection(url, *given), **kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*kept, *added])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {}  # the signature says it all; the wrapped function's strings would shadow it
    return wrapper
