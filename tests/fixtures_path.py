"""Where the third-party fixtures live: `tests/fixtures`, copied with their provenance (its README.md) from
the bytes the real systems produced. Nothing in the repository reads outside it."""

from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
