"""kvctl's one error tree, mapped once to exit codes in `kvctl.cli.main`.

    KvctlError                      exit 1
    ├── UsageError                  exit 2   a bad argument, option or input value
    ├── ConfigError                 exit 2   a bad config file or context
    ├── Unreachable                 exit 3   cannot connect to the server
    └── ApiError(status)            exit 1   the server answered with an error
        ├── NotFound                         (also a --worker or --model that names nothing: `not_found`)
        └── Refused                 (e.g. 503: every worker busy)

Decode errors of the core (`kvctl.core.events.DecodeError`) are not CLI errors: the core reports
them per event so a batch loses only its bad events.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvctl.exit_codes import ExitCode


class KvctlError(Exception):
    """Base of every error kvctl reports on purpose; anything else is a bug (shown with --debug)."""

    exit_code: int = ExitCode.ERROR

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(KvctlError):
    exit_code = ExitCode.USAGE


class ConfigError(KvctlError):
    exit_code = ExitCode.USAGE


class Unreachable(KvctlError):
    exit_code = ExitCode.UNREACHABLE


class ApiError(KvctlError):
    def __init__(self, message: str, *, status: int, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status = status


class NotFound(ApiError):
    pass


def not_found(kind: str, name: str, where: str, known: Iterable[str]) -> NotFound:
    """A worker or model named on the command line that is not there: an error naming what is (kubectl's
    `get pod nosuch`), never an empty answer that looks like a filter matching nothing."""
    return NotFound(f"{where} has no {kind} {name}", status=404, hint=there(kind, known))


def there(kind: str, known: Iterable[str], shown: int = 20) -> str:
    """The hint of a NotFound: what does exist, so the next try can be right (the first `shown`: one line)."""
    names = list(known)
    more = f", … ({len(names)} in all)" if len(names) > shown else ""
    return f"{kind}s there: {', '.join(names[:shown]) or 'none'}{more}"


class Refused(ApiError):
    pass


class AllBusy(Refused):
    """The router's 503 for a model whose every worker is over a busy threshold; a 503 for a model with no
    workers is a plain `Refused`: retrying later will not help it."""
