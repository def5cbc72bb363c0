"""`kvctl config show / use-context / set`: the contexts of kvctl's config file, kubectl-style.

`show --sources` answers "why did this command talk to that router?": every setting with where it
came from (flag > environment > context > default). The edits rewrite the file atomically. They take
--dry-run but not --yes: as kubectl's `config set` and `use-context`, editing one's own config file
asks nothing (nothing outside it changes, and `config show` shows what it holds).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from kvctl.commands._options import DryRunOpt, JsonOpt, OutputOpt, output_for, settings_for
from kvctl.errors import ConfigError, UsageError
from kvctl.output import Column, Output, View

app = typer.Typer(help="kvctl's own settings: contexts in the config file (KVCTL_CONFIG overrides its path).",
                  no_args_is_help=True)

SHOW_HELP = "Show the settings a command would use, and with --sources where each came from. (read-only)"
SHOW_EXAMPLES = "Examples:\n\n  kvctl config show --sources\n\n  kvctl --context prod config show -o json"
USE_HELP = ("Make NAME the current context of the config file; --dry-run shows the change and writes nothing. "
            "(read-write: the config file)")
USE_EXAMPLES = "Examples:\n\n  kvctl config use-context prod\n\n  kvctl config use-context prod --dry-run"
SET_HELP = (
    "Set KEY (server, token, prometheus, timeout or model) to VALUE in a context of the config file, creating the "
    "context (and the file) when new. The context edited: --context, else the one commands would use "
    "(the global --context, KVCTL_CONTEXT, the file's current-context); --dry-run shows the change and writes "
    "nothing. (read-write: the config file)"
)
SET_EXAMPLES = (
    "Examples:\n\n"
    "  kvctl config set server http://router.prod:7433 --context prod\n\n"
    "  kvctl config set timeout 10 --dry-run"
)
_MASK = "***"
_URL_KEYS = ("server", "prometheus")

_SETTING_COLUMNS = [Column("key", "key"), Column("value", "value")]
_EDIT_VIEW = View(rows=lambda edit: [edit], name_key="context",
                  columns=[Column("context", "context"), Column("key", "key"), Column("value", "value"),
                           Column("config file", "config_file")])


def _settings_view(shown: dict[str, Any], with_sources: bool) -> View:
    columns = [*_SETTING_COLUMNS, Column("source", "source")] if with_sources else _SETTING_COLUMNS
    return View(
        rows=lambda data: [{"key": key, "value": value, "source": data.get("sources", {}).get(key)}
                           for key, value in data["settings"].items()],
        columns=columns, name_key="key",
        title=f"context: {shown['context'] or 'none'} ({shown['config_file']})",
    )


@app.command("show", help=SHOW_HELP, epilog=SHOW_EXAMPLES)
def show_command(
    ctx: typer.Context,
    sources: Annotated[bool, typer.Option("--sources", help="Say where each value came from.")] = False,
    show_token: Annotated[bool, typer.Option("--show-token",
                                             help="Print the token and URL passwords instead of ***.")] = False,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from kvctl.config import KEYS, ConfigFile

    out = output_for(ctx, output, as_json)
    file = ConfigFile.load()
    settings = settings_for(ctx)
    values = {key: getattr(settings, key) for key in KEYS}  # typed: an env var's "3" shows as 3.0
    if not show_token:
        if values["token"] is not None:
            values["token"] = _MASK
        for key in _URL_KEYS:
            values[key] = _masked_url(values[key])
    shown: dict[str, Any] = {"config_file": str(file.path), "context": settings.context,
                             "contexts": sorted(file.contexts), "settings": values}
    if sources:
        shown["sources"] = settings.sources
    out.emit(shown, _settings_view(shown, sources))


@app.command("use-context", help=USE_HELP, epilog=USE_EXAMPLES)
def use_context_command(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="A context of the config file.")],
    dry_run: DryRunOpt = False,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from kvctl.config import ConfigFile

    out = output_for(ctx, output, as_json)
    file = ConfigFile.load()
    if name not in file.contexts:
        raise ConfigError(f"no context {name!r} in {file.path}",
                          hint=f"known: {', '.join(sorted(file.contexts)) or 'none'}; create one with "
                               "'kvctl config set server URL --context NAME'")
    _edit(out, file.path, {**file.data, "current-context": name},
          {"context": name, "key": "current-context", "value": name}, dry_run)


@app.command("set", help=SET_HELP, epilog=SET_EXAMPLES)
def set_command(
    ctx: typer.Context,
    key: Annotated[str, typer.Argument(help="server, token, prometheus, timeout or model.")],
    value: Annotated[str, typer.Argument(help="The value (a URL, a token, or seconds for timeout).")],
    context: Annotated[str | None, typer.Option("--context", help="The context to edit (created when new).",
                                                show_default=False)] = None,
    dry_run: DryRunOpt = False,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from kvctl.config import ConfigFile

    out = output_for(ctx, output, as_json)
    typed = _typed(key, value)
    file = ConfigFile.load()
    name = context or ctx.find_root().obj.context or os.environ.get("KVCTL_CONTEXT") or file.current
    if name is None:
        raise UsageError("no context to set it in (the config file has no current-context)",
                         hint="pass --context NAME; a new context is created")
    contexts = {n: dict(c) for n, c in file.contexts.items()}
    contexts.setdefault(name, {})[key] = typed
    data = {**file.data, "contexts": contexts}
    if file.current is None:
        data["current-context"] = name
        out.note(f"{name} {'would become' if dry_run else 'is now'} the current context (the config file had none)")
    _edit(out, file.path, data,
          {"context": name, "key": key, "value": _MASK if key == "token" else _masked_url(typed)}, dry_run)


def _edit(out: Output, path: Path, data: dict[str, Any], edit: dict[str, Any], dry_run: bool) -> None:
    """Write the config file's new `data` and show the `edit`; with --dry-run, only show it."""
    if dry_run:
        out.note(f"dry run: {path} was not changed")
    else:
        from kvctl.config import writer

        writer.write(path, data)
    out.emit({**edit, "config_file": str(path), **({"dry_run": True} if dry_run else {})}, _EDIT_VIEW)


def _masked_url(value: Any) -> Any:
    """A URL with the password of its userinfo (http://user:PASSWORD@host) replaced by ***."""
    if not isinstance(value, str) or "@" not in value:
        return value
    scheme, sep, rest = value.partition("://")
    authority, slash, tail = rest.partition("/")
    userinfo, at, host = authority.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    if not (sep and at and colon):
        return value
    return f"{scheme}://{user}:{_MASK}@{host}{slash}{tail}"


def _typed(key: str, value: str) -> str | float:
    """VALUE as the config file holds KEY: timeout a positive number of seconds, URLs with their scheme."""
    from kvctl.config import KEYS

    if key not in KEYS:
        raise UsageError(f"unknown key {key!r}", hint=f"one of {', '.join(KEYS)}")
    if key == "timeout":
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            raise UsageError(f"timeout must be a positive number of seconds, got {value!r}")
        return seconds
    if key in _URL_KEYS and not value.startswith(("http://", "https://")):
        raise UsageError(f"{key} must be an http:// or https:// URL, got {value!r}")
    return value
