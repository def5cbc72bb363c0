"""docs/architecture.md's table of modules cannot drift from `kvctl/`: every module has a row that names it, and
every module a row names exists. A row names modules of one folder: its first `kvctl/...` path gives the folder,
and each `name.py` (or `.c`) in the row is a module of it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
_PATH = re.compile(r"`(kvctl/[\w/.*]*)`")
_NAME = re.compile(r"`(?:kvctl/[\w/]*/)?(\w+\.(?:py|c))`")


def documented() -> set[str]:
    named = set()
    for row in DOC.read_text().splitlines():
        paths = _PATH.findall(row) if row.startswith("| `kvctl/") else []
        if paths:
            folder = paths[0] if paths[0].endswith("/") else paths[0].rsplit("/", 1)[0] + "/"
            named |= {path for path in paths if path.endswith((".py", ".c"))}
            named |= {folder + name for name in _NAME.findall(row)}
    return named


def modules() -> set[str]:
    found = {p.relative_to(ROOT).as_posix() for p in (ROOT / "kvctl").rglob("*") if p.suffix in (".py", ".c")}
    return {m for m in found if not m.endswith(("__init__.py", "__main__.py"))}


def test_every_module_is_in_the_table() -> None:
    missing = sorted(modules() - documented())
    assert not missing, f"modules with no row in {DOC.name}: {missing}"


def test_every_module_in_the_table_exists() -> None:
    stale = sorted(documented() - modules())
    assert not stale, f"rows of {DOC.name} naming modules that do not exist: {stale}"
