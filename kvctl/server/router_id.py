"""A router's identity on the event plane: its JetStream consumer's name and its replica-sync id.

It must survive restarts (a new id would orphan the old consumer until the server expires it), so it
is kept in the state dir; two routers sharing a state dir would share an id, which `--router-id`
overrides.
"""

from __future__ import annotations

import secrets
from pathlib import Path

FILENAME = "router-id"


def stable_router_id(state_dir: Path) -> int:
    path = state_dir / FILENAME
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        pass
    router_id = secrets.randbits(63)
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{router_id}\n")
    tmp.replace(path)
    return router_id
