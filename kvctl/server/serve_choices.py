"""The values of `kvctl serve`'s choice flags, as StrEnums: the command declares `--decoder`, `--log-format` and
`--log-level` with them (so `--help` lists the values and a typo exits 2 naming them), and the daemon takes them.

Apart from the code that acts on them (`ingest/decode_process/parent.py`, `logs.py`) because the command must import
them when it is defined: this module imports nothing, so `kvctl serve --help` and shell completion load no server
code.
"""

from enum import StrEnum


class DecoderMode(StrEnum):
    """Where engine payloads are received and decoded (see `decoder.make_decoder`)."""

    auto = "auto"
    inline = "inline"
    process = "process"


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"
    critical = "critical"


class LogFormat(StrEnum):
    """Human text, or one JSON object per line for log pipelines."""

    text = "text"
    json = "json"
