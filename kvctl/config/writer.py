"""Writing kvctl's config file (`kvctl.config.settings` only reads it).

No TOML writer is a dependency, and the file's format is small and fixed: `current-context` and
`[contexts.NAME]` tables of string and number values. So it is rendered here, quoted by TOML's rules,
and rewritten whole, atomically (a temporary file in the same folder, then a rename), so a crash or a
full disk never leaves a half-written config behind.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvctl.errors import ConfigError, KvctlError

_KNOWN_TOP_LEVEL = {"current-context", "contexts"}
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def toml_string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped, anything else as is."""
    return '"' + "".join(_ESCAPES.get(ch) or (f"\\u{ord(ch):04X}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch)
                         for ch in text) + '"'


def _key(name: str) -> str:
    return name if _BARE_KEY.fullmatch(name) else toml_string(name)


def _value(key: str, value: Any) -> str:
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return repr(value)
    raise ConfigError(f"cannot write {key} = {value!r} to the config file", hint="values are strings or numbers")


def render(data: Mapping[str, Any]) -> str:
    """The config file's text for `data` (as `kvctl.config.ConfigFile` holds it)."""
    unknown = set(data) - _KNOWN_TOP_LEVEL
    if unknown:
        raise ConfigError(f"the config file has top-level keys kvctl does not write ({', '.join(sorted(unknown))})",
                          hint="edit the file by hand, or remove them")
    lines = []
    if data.get("current-context") is not None:
        lines.append(f"current-context = {toml_string(data['current-context'])}")
    for name, context in data.get("contexts", {}).items():
        lines += ["", f"[contexts.{_key(name)}]"]
        lines += [f"{_key(key)} = {_value(key, value)}" for key, value in context.items() if value is not None]
    return "\n".join(lines).lstrip("\n") + "\n"


def write(path: Path, data: Mapping[str, Any]) -> None:
    """Replace the config file at `path` with `data`, atomically (see `replace_text`)."""
    replace_text(path, render(data))


def replace_text(path: Path, text: str) -> None:
    """Replace the file at `path` (through a symlink, to its target) with `text`, atomically.

    A new file is readable by its owner only (it may hold a token); an existing one keeps its mode.
    """
    target = Path(os.path.realpath(path))
    temporary: str | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        if target.exists():
            os.chmod(temporary, stat.S_IMODE(target.stat().st_mode))
        os.replace(temporary, target)
    except OSError as exc:
        _remove(temporary)
        raise KvctlError(f"cannot write the config file {target}: {exc.strerror or exc}") from None
    except BaseException:
        _remove(temporary)
        raise


def _remove(temporary: str | None) -> None:
    if temporary is not None:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
