"""The exit codes kvctl promises to scripts (published in the README).

Two tables because their values overlap: ordinary commands use `ExitCode`, check-style commands
(`doctor`, `tiers --warn/--crit`) use Nagios' `CheckStatus`.
"""

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    ERROR = 1  # runtime or server error; also "different" for diff commands run with --exit-code
    USAGE = 2  # bad argument or option
    UNREACHABLE = 3  # cannot reach the server: a router, NATS, a discovery store
    NOTHING_RECEIVED = 4  # a tap (`events tail`/`record`) ended without one message: a quiet or wrong source


class CheckStatus(IntEnum):
    OK = 0
    WARNING = 1
    CRITICAL = 2
    UNKNOWN = 3
