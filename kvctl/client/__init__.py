"""The only code that speaks HTTP to a router (DESIGN §2): calls are built in `_base`, sent by either client."""

from kvctl.client import _base as calls
from kvctl.client.aio import AsyncRouterClient
from kvctl.client.sync import RouterClient

__all__ = ["AsyncRouterClient", "RouterClient", "calls"]
