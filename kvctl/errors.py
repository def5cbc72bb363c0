"""kvctl's one error tree, mapped once to exit codes in `kvctl.cli.main`.

    KvctlError                      exit 1
    ├── UsageError                  exit 2   a bad argument, option or input value
    │   ├── StateDirError                    a `serve --state-dir` that cannot be used (not writable, in use)
    │   └── CannotListen                     a `serve --listen` address that cannot be had
    ├── ConfigError                 exit 2   a bad config file (`kvctl serve --config` too) or context
    ├── TimedOut                    exit 1   a server that did not answer within --timeout
    ├── Unreachable                 exit 3   cannot connect to the server (a router, NATS, a discovery store)
    │   └── DiscoveryError                   Dynamo's discovery store cannot be read now (the next poll retries)
    ├── SnapshotError               exit 1   a damaged router snapshot (the router starts without it)
    └── ApiError(status)            exit 1   an error with an HTTP status: the server's answer, or its reason
        ├── NotFound                         (also a --worker or --model that names nothing: `not_found`)
        │   └── UnknownModel                 a model the router does not have (404, naming those it has)
        └── Refused                 (e.g. 503: every worker busy)

The router answers an `ApiError` raised while serving a request with its status, message and `fields`.

Decode errors of the core (`kvctl.core.events.DecodeError`) are not CLI errors: the core reports
them per event so a batch loses only its bad events. The core's refusals of a value (`ThresholdError`,
`BadKnob`, `PolicyConfigError`: `ValueError`s, as the core imports nothing of kvctl) become a `UsageError`
(or a 400 `ApiError`) where the layer above read the value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

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


class StateDirError(UsageError):
    """The message names --state-dir and the hint says what to do: one line, exit 2."""


class CannotListen(UsageError):
    """The listening socket could not be had (address in use, not ours, bad host): the operator's choice of
    address, unlike any other OSError of the router's life."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"cannot listen on {address}: {reason}", hint="pick another --listen port")


class TimedOut(KvctlError):
    """A server that did not answer within --timeout: up, perhaps, but too slow now; a `--watch` tries again."""


class Unreachable(KvctlError):
    exit_code = ExitCode.UNREACHABLE


class DiscoveryError(Unreachable):
    """The store cannot be read now (gone, unreachable, refused); a router's next poll tries again."""


class SnapshotError(KvctlError):
    """A snapshot file that cannot be restored, naming the file and its first problem."""


class ApiError(KvctlError):
    """`fields`: what the router's answer carries beside the message, for a client to act on."""

    def __init__(self, message: str, *, status: int, hint: str | None = None,
                 fields: Mapping[str, Any] | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status = status
        self.fields = dict(fields or {})


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


class UnknownModel(NotFound):
    """A model is declared in the serve config or made by a worker's registration, never by naming it: the 404
    says how one is made, and lists the models there are (`models`), so the next try can be right."""

    def __init__(self, model: str, known: Iterable[str]) -> None:
        models = sorted(known)
        super().__init__(f"unknown model {model!r}: a model is declared in `kvctl serve --config` ([[models]]) or "
                         "made by registering a worker for it (POST /v1/workers)", status=404,
                         hint=there("model", models), fields={"models": models})
        self.model = model


class Refused(ApiError):
    pass


class NoWorkers(Refused):
    """The 503 of a route for a model with no worker: it names the model and the models that do have workers
    (`workers_by_model`), since the common cause is the wrong model, not a missing registration."""

    def __init__(self, model: str, workers_by_model: Mapping[str, int], pool: str | None = None) -> None:
        """`pool`: the one of a disaggregated model's two (prefill, decode) that has none."""
        elsewhere = {m: n for m, n in sorted(workers_by_model.items()) if n and m != model}
        fix = (f"models with workers: {', '.join(f'{m} ({n})' for m, n in elsewhere.items())}: name one "
               "(-m MODEL, or the request's model)" if elsewhere and pool is None else
               "register one: kvctl serve --worker ID=tcp://HOST:PORT, or POST /v1/workers")
        kind = "workers" if pool is None else f"workers in its {pool} pool"
        super().__init__(f"model {model!r} has no {kind} to route to; {fix}", status=503,
                         fields={"workers_by_model": elsewhere})


class Restoring(Refused):
    """The router's 503 while a restart restores its index: up, not yet whole. Exit 3, as its closed port was
    during the restore before the port opened at once: a script that retries an unreachable router retries it."""

    exit_code = ExitCode.UNREACHABLE


class AllBusy(Refused):
    """The router's 503 for a model whose every worker is over a busy threshold; a 503 for a model with no
    workers is a plain `Refused`: retrying later will not help it."""
