"""The root command: global options, sub-command registration, and the one place errors become exit codes."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

import typer
from typer.core import TyperGroup
from typer.exceptions import Abort, Exit

from kvctl import __version__
from kvctl.commands import busy as busy_cmd
from kvctl.commands import config_cmd
from kvctl.commands import demo as demo_cmd
from kvctl.commands import events as events_cmd
from kvctl.commands import hash as hash_cmd
from kvctl.commands import mock as mock_cmd
from kvctl.commands import route as route_cmd
from kvctl.commands import router as router_cmd
from kvctl.commands import serve as serve_cmd
from kvctl.commands import tiers as tiers_cmd
from kvctl.commands import tree as tree_cmd
from kvctl.commands import workers as workers_cmd
from kvctl.commands._options import JsonOpt, OutputOpt
from kvctl.errors import KvctlError
from kvctl.exit_codes import ExitCode
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


class KvctlGroup(TyperGroup):
    """Runs the app in non-standalone mode so every failure is reported the same way: one line on stderr."""

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        try:
            rv = super().main(argv, prog_name or "kvctl", complete_var, standalone_mode=False, **extra)
        except typer.BadParameter as exc:
            _fail(exc.format_message(), _help_hint(exc), ExitCode.USAGE)
        except typer._click.exceptions.UsageError as exc:  # noqa: SLF001 - typer vendors click here
            _fail(exc.format_message(), _help_hint(exc), ExitCode.USAGE)
        except KvctlError as exc:
            if _debug_requested(argv):
                raise
            _fail(exc.message, exc.hint, exc.exit_code)
        except Exit as exc:
            sys.exit(exc.exit_code)
        except Abort:
            _fail("aborted", None, ExitCode.ERROR)
        sys.exit(rv if isinstance(rv, int) else ExitCode.OK)


def _help_hint(exc: Any) -> str:
    ctx = getattr(exc, "ctx", None)
    path = ctx.command_path if ctx is not None else "kvctl"
    return f"see '{path} --help'"


def _fail(message: str, hint: str | None, code: int) -> None:
    sys.stderr.write(f"error: {message}" + (f" ({hint})" if hint else "") + "\n")
    sys.exit(code)


app = typer.Typer(
    cls=KvctlGroup,
    name="kvctl",
    help="Admin and diagnostics for KV-cache-aware LLM routing (Dynamo-compatible).",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"kvctl {__version__}\n")
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
                                         help="Seconds to wait for an answer (KVCTL_TIMEOUT; default 5)."),
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


app.command(name="hash", help=hash_cmd.HELP, epilog=hash_cmd.EXAMPLES)(hash_cmd.hash_command)
app.command(name="serve", help=serve_cmd.HELP, epilog=serve_cmd.EXAMPLES)(serve_cmd.serve_command)
app.command(name="demo", help=demo_cmd.HELP, epilog=demo_cmd.EXAMPLES)(demo_cmd.demo_command)
app.command(name="route", help=route_cmd.HELP, epilog=route_cmd.EXAMPLES)(route_cmd.route_command)
app.command(name="workers", help=workers_cmd.HELP, epilog=workers_cmd.EXAMPLES)(workers_cmd.workers_command)
app.command(name="tiers", help=tiers_cmd.HELP, epilog=tiers_cmd.EXAMPLES)(tiers_cmd.tiers_command)
app.add_typer(mock_cmd.app, name="mock")
app.add_typer(events_cmd.app, name="events")
app.add_typer(tree_cmd.app, name="tree")
app.add_typer(router_cmd.app, name="router")
app.add_typer(busy_cmd.app, name="busy")
app.add_typer(config_cmd.app, name="config")


def main() -> None:
    app()
