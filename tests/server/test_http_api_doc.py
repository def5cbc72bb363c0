"""docs/http-api.md cannot drift from the router: every route `kvctl serve` answers has its `### METHOD /path`
section there, and every section names a route the router answers. A route added without a word, or a section
left behind by a removed route, fails here."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from kvctl.server.http.api import create_app
from kvctl.server.state import Fleet

DOC = Path(__file__).resolve().parents[2] / "docs" / "http-api.md"
_SECTION = re.compile(r"^### (GET|POST|PUT|PATCH|DELETE) (/\S*)$", re.M)


def documented() -> set[tuple[str, str]]:
    return set(_SECTION.findall(DOC.read_text()))


async def served() -> set[tuple[str, str]]:
    """The routes the app registers (HEAD, which the framework adds to each GET, aside) and those /openapi.json
    describes: POST /v1/route is answered ahead of the framework, so only the document lists it."""
    app = create_app(Fleet())
    routes = {(method, route.path) for route in app.app.routes  # type: ignore[attr-defined]
              for method in getattr(route, "methods", None) or () if method != "HEAD"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvctl") as client:
        paths = (await client.get("/openapi.json")).json()["paths"]
    return routes | {(method.upper(), path) for path, item in paths.items() for method in item}


async def test_every_route_the_router_answers_is_documented() -> None:
    missing = sorted(await served() - documented())
    assert not missing, f"routes with no `### METHOD /path` section in {DOC.name}: {missing}"


async def test_every_documented_route_is_answered() -> None:
    stale = sorted(documented() - await served())
    assert not stale, f"sections of {DOC.name} for routes the router does not have: {stale}"

