"""No module of kvctl over 600 lines (issue 24): past that a module holds more than one idea, and a reader
cannot keep it in view. Split it along a seam (as `core/index/removal.py` left `radix.py`) instead of raising this."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600


def sizes() -> dict[str, int]:
    return {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in (ROOT / "kvctl").rglob("*.py")}


def test_no_module_over_the_limit() -> None:
    over = {path: n for path, n in sorted(sizes().items()) if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split each along a seam): {over}"
