"""The root command: global options, sub-command registration, and the one place errors become exit codes."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption
from typer.exceptions import Abort, Exit

from kvctl import __version__
from kvctl.argv_secrets import scrub_process_argv
from kvctl.commands._options import JsonOpt, OutputOpt
from kvctl.errors import KvctlError
from kvctl.exit_codes import CheckStatus, ExitCode
from kvctl.output import OutputFormat


@dataclass
class CliState:
    output: OutputFormat = OutputFormat.table
    color: bool = True
    debug: bool = False
    flags: dict[str, Any] = field(default_factory=dict)  # --server, --token, --timeout, --prometheus as given
    context: str | None = None


def _debug_requested(args: list[str]) -> bool:
    return "--debug" in args or os.environ.get("KVCTL_DEBUG", "") not in ("", "0")


# Every sub-command and the module that defines it, in the order `kvctl --help` lists them. A module
# defines either `app` (a group) or `<name>_command` with HELP and EXAMPLES (a single command).
COMMANDS: dict[str, str] = {
    "hash": "kvctl.commands.hash", "serve": "kvctl.commands.serve", "demo": "kvctl.commands.demo",
    "route": "kvctl.commands.route", "workers": "kvctl.commands.workers", "audit": "kvctl.commands.audit",
    "tiers": "kvctl.commands.tiers",
    "top": "kvctl.commands.top",
    "mock": "kvctl.commands.mock", "events": "kvctl.commands.events", "tree": "kvctl.commands.tree",
    "router": "kvctl.commands.router", "busy": "kvctl.commands.busy", "doctor": "kvctl.commands.doctor",
    "config": "kvctl.commands.config_cmd",
}


def _load_command(name: str) -> typer.core.TyperCommand | TyperGroup:
    module = importlib.import_module(COMMANDS[name])
    group = getattr(module, "app", None)
    if group is not None:
        command: typer.core.TyperCommand | TyperGroup = typer.main.get_group(group)
    else:  # add_completion: the root has the completion options, not every command
        single = typer.Typer(add_completion=False)
        single.command(name=name, help=module.HELP, epilog=module.EXAMPLES)(getattr(module, f"{name}_command"))
        command = typer.main.get_command(single)  # type: ignore[assignment]
    command.name = name
    _plain_help(command)
    return command


def _plain_help(command: TyperCommand | TyperGroup) -> None:
    """click's help layout for a command and its sub-commands: rich's options table cuts long option names
    at 80 columns (`--active-prefill-to…`); click's gives a name its own line. Example lines stay as written
    (`\\b`: not re-wrapped), so a copied example is never broken at a hyphen; prose wraps."""
    command.rich_markup_mode = None
    if command.epilog:
        command.epilog = "\n\n".join(f"\b\n{part}" if part.lstrip().startswith("kvctl ") else part
                                       for part in command.epilog.split("\n\n"))
    for sub in (command.commands.values() if isinstance(command, TyperGroup) else ()):
        assert isinstance(sub, TyperCommand | TyperGroup)  # typer makes each command of a Typer app one
        _plain_help(sub)


class _LazyCommands(Mapping[str, Any]):
    """The root group's commands, each imported when first named: `kvctl tree stats` loads the tree
    command and not the server, the mock engines or NATS, which keeps a runbook's calls fast."""

    def __init__(self) -> None:
        self._loaded: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._loaded:
            if name not in COMMANDS:
                raise KeyError(name)
            self._loaded[name] = _load_command(name)
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(COMMANDS)

    def __len__(self) -> int:
        return len(COMMANDS)


class KvctlGroup(TyperGroup):
    """Runs the app in non-standalone mode so every failure is reported the same way: one line on stderr."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands = _LazyCommands()  # type: ignore[assignment]  # read-only: nothing adds commands later

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, windows_expand_args: bool = True, **extra: Any) -> Any:
        argv = hoist_global_options(self, list(sys.argv[1:] if args is None else args))
        if args is None:
            scrub_process_argv()
        fail = _Failure(check_of(argv))
        try:
            argv = _dynamo_flags_translated(argv)
            rv = super().main(argv, prog_name or "kvctl", complete_var, standalone_mode=False,
                              windows_expand_args=windows_expand_args, **extra)
        except typer.BadParameter as exc:
            fail(exc.format_message(), _help_hint(exc), ExitCode.USAGE)
        except typer._click.exceptions.NoArgsIsHelpError as exc:  # noqa: SLF001 - bare `kvctl`, `kvctl tree`
            # help was asked for by giving nothing: it is the answer (stdout, exit 0), as with kubectl, not an error
            assert exc.ctx is not None
            sys.stdout.write(exc.ctx.get_help() + "\n")
            sys.exit(ExitCode.OK)
        except typer._click.exceptions.UsageError as exc:  # noqa: SLF001 - typer vendors click here
            fail(exc.format_message(), _help_hint(exc), ExitCode.USAGE)
        except KvctlError as exc:
            if _debug_requested(argv):
                raise
            fail(exc.message, exc.hint, exc.exit_code)
        except Exit as exc:
            sys.exit(exc.exit_code)
        except Abort:
            fail("aborted", None, ExitCode.ERROR)
        sys.exit(rv if isinstance(rv, int) else ExitCode.OK)


GLOBAL_FLAGS = frozenset({"--no-color", "--debug"})
GLOBAL_VALUED = frozenset({"--server", "-s", "--token", "--timeout", "--context"})
_ROOT_VALUED = GLOBAL_VALUED | {"--output", "-o"}


def hoist_global_options(group: TyperGroup, argv: list[str]) -> list[str]:
    """Global options written after the sub-command, moved before it: runbooks write `kvctl doctor --server URL`
    as kubectl and nats allow. A sub-command's own option of the same name stays its own (`config set
    --context`, `mock load --server`); nothing after `--` moves."""
    at = _command_start(argv)
    if at is None:
        return argv
    command: TyperCommand | TyperGroup | None = group
    path_end = at
    while isinstance(command, TyperGroup) and path_end < len(argv) and not argv[path_end].startswith("-"):
        sub = command.commands.get(argv[path_end]) if argv[path_end] in command.commands else None
        assert sub is None or isinstance(sub, TyperCommand | TyperGroup)  # typer makes each command one
        command = sub
        path_end += 1
    if command is None or isinstance(command, TyperGroup):
        return argv
    own = {opt: not (p.is_flag or p.count) for p in command.params if isinstance(p, TyperOption)
           for opt in (*p.opts, *p.secondary_opts)}
    kept = argv[:path_end]
    hoisted: list[str] = []
    i = path_end
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if token == "--":
            kept += argv[i:]
            break
        takes_value = "=" not in token and (own.get(name) if name in own else name in GLOBAL_VALUED)
        into = hoisted if name not in own and name in GLOBAL_VALUED | GLOBAL_FLAGS else kept
        into += argv[i:i + 2] if takes_value else [token]
        i += 2 if takes_value else 1
    return argv[:at] + hoisted + kept[at:]


def _dynamo_flags_translated(argv: list[str]) -> list[str]:
    """`kvctl serve` takes a Dynamo frontend's router flags (`commands/_dynamo_flags.py`)."""
    at = _command_start(argv)
    if at is None or argv[at] != "serve":
        return argv
    from kvctl.commands._dynamo_flags import translate

    return argv[:at + 1] + translate(argv[at + 1:])


def _command_start(argv: list[str]) -> int | None:
    """Where the sub-command's name is, past the root's own options; None when there is none."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("-"):
            return i
        i += 2 if token in _ROOT_VALUED else 1
    return None


CHECKS: dict[str, frozenset[str]] = {"doctor": frozenset(), "tiers": frozenset({"--warn", "--crit"})}
"""The commands whose exit code is a monitoring plugin's (`CheckStatus`): always, or given one of these options
(or `-o nagios`). In one, an error that stops the check (a usage error, a source not reached) is UNKNOWN, exit 3:
Nagios reads the usual exit 2 as CRITICAL, and a typo in a check's options must not page as a critical fleet."""


@dataclass(frozen=True)
class Check:
    """A command line that runs a check: which one, and whether it prints a plugin's output (-o nagios)."""

    name: str
    nagios: bool


def check_of(argv: list[str]) -> Check | None:
    """The check this command line runs, or None (read from the words, as parsing may be what failed)."""
    words = argv[:argv.index("--")] if "--" in argv else argv
    at = _command_start(words)
    if at is None or words[at] not in CHECKS:
        return None
    nagios = any(w in ("-onagios", "--output=nagios") or (w in ("-o", "--output") and words[n + 1:n + 2] == ["nagios"])
                 for n, w in enumerate(words))
    given = {w.split("=", 1)[0] for w in words[at + 1:]}
    if CHECKS[words[at]] and not nagios and not given & CHECKS[words[at]]:
        return None
    return Check(words[at], nagios)


class _Failure:
    """How this command line reports an error that stops it: one line on stderr with the error's exit code; in a
    check, exit 3 UNKNOWN, and with -o nagios the line is the plugin's status line, on stdout."""

    def __init__(self, check: Check | None) -> None:
        self.check = check

    def __call__(self, message: str, hint: str | None, code: int) -> NoReturn:
        if self.check is None:
            _fail(message, hint, code)
        if not self.check.nagios:
            _fail(message, hint, CheckStatus.UNKNOWN)
        from kvctl.core.nagios import plugin_output

        text = f"error: {message}" + (f" ({hint})" if hint else "")
        sys.stdout.write(plugin_output(self.check.name, CheckStatus.UNKNOWN.name, text) + "\n")
        sys.exit(CheckStatus.UNKNOWN)


def _help_hint(exc: Any) -> str:
    ctx = getattr(exc, "ctx", None)
    path = ctx.command_path if ctx is not None else "kvctl"
    return f"see '{path} --help'"


def _fail(message: str, hint: str | None, code: int) -> NoReturn:
    sys.stderr.write(f"error: {message}" + (f" ({hint})" if hint else "") + "\n")
    sys.exit(code)


app = typer.Typer(
    cls=KvctlGroup,
    name="kvctl",
    help="Admin and diagnostics for KV-cache-aware LLM routing (Dynamo-compatible).",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's help layout, as every sub-command's (see _plain_help)
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    """The version, and whether the C speedups were built: a bug report's first line says which path ran."""
    if value:
        from kvctl.core import native

        sys.stdout.write(f"kvctl {__version__} (native speedups: {native.IMPLEMENTATION})\n")
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
    no_color: bool = typer.Option(False, "--no-color", help="Plain output without colour."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks (also KVCTL_DEBUG=1)."),
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
    server: str | None = typer.Option(None, "--server", "-s", show_default=False,
                                      help="Router URL (KVCTL_SERVER; default http://127.0.0.1:7433)."),
    token: str | None = typer.Option(None, "--token", show_default=False,
                                     help="The router's admin token (KVCTL_TOKEN)."),
    timeout: float | None = typer.Option(None, "--timeout", show_default=False,
                                         help="Seconds a call to the router may take in all, however slowly it "
                                              "answers (KVCTL_TIMEOUT; default 5). doctor: for the whole check."),
    context: str | None = typer.Option(None, "--context", show_default=False,
                                       help="A context of the config file (KVCTL_CONTEXT)."),
) -> None:
    ctx.obj = CliState(
        output=OutputFormat.json if as_json else (output or OutputFormat.table),
        color=not no_color and "NO_COLOR" not in os.environ,
        debug=debug,
        flags={"server": server, "token": token, "timeout": timeout},
        context=context,
    )


def main() -> None:
    app()
