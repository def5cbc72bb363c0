"""The only code that speaks HTTP to a router (docs/architecture.md): calls are built in `_base`, sent by either
client."""

import sys

# httpx imports its own command-line tool (click, pygments, rich.progress) whenever click is installed,
# ~50 ms of every kvctl command for a tool kvctl never runs; a None entry makes that import fail, and
# httpx falls back to a stub `httpx.main`. Nothing else changes.
sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]

from kvctl.client import _base as calls  # noqa: E402 - after the httpx._main entry above
from kvctl.client.aio import AsyncRouterClient  # noqa: E402
from kvctl.client.sync import RouterClient  # noqa: E402

__all__ = ["AsyncRouterClient", "RouterClient", "calls"]
