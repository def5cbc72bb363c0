"""A router's identity on the event plane: its JetStream consumer's name and its replica-sync id.

It must survive restarts (a new id would orphan the old consumer until the server expires it), so it
is kept in the state dir; two routers sharing a state dir would share an id, which `--router-id`
overrides.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from kvctl.server.persistence.state_dir import unwritable

FILENAME = "router-id"


def stable_router_id(state_dir: Path) -> int:
    """Raises StateDirError when a new id cannot be kept."""
    path = state_dir / FILENAME
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        pass
    router_id = secrets.randbits(63)
    tmp = path.with_suffix(".tmp")
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp.write_text(f"{router_id}\n")
        tmp.replace(path)
    except OSError as exc:  # kept nowhere, it would change at every start: refuse to start instead
        raise unwritable(state_dir, exc) from None
    return router_id
