"""A check's result as a monitoring plugin prints it (the Nagios plugin guidelines, which Icinga, NRPE, Naemon and
Sensu read too): `KVCTL DOCTOR WARNING - <summary> | <perfdata>` as the first line, the alert's text; then one
long-output line per other finding. Shared by `doctor` and `tiers -o nagios`; pure formatting."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

STATUSES = ("OK", "WARNING", "CRITICAL", "UNKNOWN")
"""A check's statuses, in the order of their exit codes (0-3)."""


@dataclass(frozen=True, slots=True)
class Perf:
    """One performance datum: `'label'=value[UOM];[warn];[crit];[min];[max]`, what a plugin's graphs read."""

    label: str
    value: float
    uom: str = ""  # "", "%", "s", "B" or "c" (a counter)
    warn: float | None = None
    crit: float | None = None
    min: float | None = None
    max: float | None = None

    def __str__(self) -> str:
        label = self.label.replace("'", "''").replace("=", "_")
        limits = ["" if x is None else _number(x) for x in (self.warn, self.crit, self.min, self.max)]
        return f"'{label}'=" + ";".join([_number(self.value) + self.uom, *limits]).rstrip(";")


def plugin_output(check: str, status: str, summary: str, perfdata: Sequence[Perf] = (),
                  details: Sequence[str] = ()) -> str:
    """The status line, then `details` one a line (no trailing newline). A `|` in a text would start the
    perfdata and a newline would end the alert's text, so neither survives in one."""
    assert status in STATUSES, status
    line = f"KVCTL {check.upper()} {status} - {_one_line(summary)}"
    if perfdata:
        line += " | " + " ".join(str(p) for p in perfdata)
    return "\n".join([line, *(_one_line(d) for d in details)])


def _one_line(text: str) -> str:
    return " ".join("".join(ch if ch.isprintable() else " " for ch in text.replace("|", "/")).split())


def _number(value: float) -> str:
    """A decimal, never an exponent (`1e-05` is no number to most perfdata parsers)."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")
