"""docs/configuration.md cannot drift from the two readers it documents: every key `serve --config` and the client
config accept has its table row, no row names a key they refuse, and the doc's example files load."""

from __future__ import annotations

import re
from pathlib import Path

from kvctl.config import KEYS, ConfigFile
from kvctl.server import config_file

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
TEXT = DOC.read_text()
_ROW_KEY = re.compile(r"^\| `([a-z_]+)` \|", re.M)
SERVE_KEYS = {*config_file._MODEL_KEYS, *config_file._WORKER_KEYS}  # noqa: SLF001 - the reader's own key sets


def _tomls() -> list[str]:
    return re.findall(r"^```toml\n(.*?)^```", TEXT, re.M | re.S)


def test_every_accepted_key_has_a_row_and_every_row_an_accepted_key() -> None:
    rows = set(_ROW_KEY.findall(TEXT))
    accepted = SERVE_KEYS | set(KEYS)
    assert not accepted - rows, f"keys with no row in {DOC.name}: {sorted(accepted - rows)}"
    assert not rows - accepted, f"rows of {DOC.name} for keys nothing reads: {sorted(rows - accepted)}"


def test_the_example_files_load(tmp_path: Path) -> None:
    serve_toml, client_toml = _tomls()
    (tmp_path / "router.toml").write_text(serve_toml)
    (tmp_path / "config.toml").write_text(client_toml)
    declared = config_file.load(tmp_path / "router.toml")
    assert [m.name for m in declared.models] and declared.workers
    client = ConfigFile.load(tmp_path / "config.toml")
    assert client.current in client.contexts
