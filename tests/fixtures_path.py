"""Where the shared third-party fixtures live: `shared/fixtures` beside the repository checkout."""

from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
