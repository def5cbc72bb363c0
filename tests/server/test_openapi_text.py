"""/openapi.json speaks to the API's users: what a call does and answers, never how kvctl is built."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx

from kvctl.server.http.api import create_app
from kvctl.server.state import Fleet

# Words of the implementation: its libraries, its performance, its internals.
IMPLEMENTATION = re.compile(r"msgspec|pydantic|fastapi|axum|serde|extractor|µs|\bms\b|hot path|C reader|"
                            r"decoded with|kvctl's (?:message|addition)|_Front|event loop", re.IGNORECASE)


def _texts(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("description", "summary", "title") and isinstance(value, str):
                yield value
            yield from _texts(value)
    elif isinstance(node, list):
        for value in node:
            yield from _texts(value)


async def test_no_description_holds_an_implementation_note() -> None:
    transport = httpx.ASGITransport(app=create_app(Fleet()))
    async with httpx.AsyncClient(transport=transport, base_url="http://kvctl") as client:
        document = (await client.get("/openapi.json")).json()
    texts = list(_texts(document))
    assert len(texts) > 20  # the walk reaches the operations and the schemas
    assert [t for t in texts if IMPLEMENTATION.search(t)] == []
    route_body = document["components"]["schemas"]["RouteBody"]["description"]
    assert "token_ids" in route_body and "local_hashes" in route_body


async def test_the_viewer_pages_say_when_their_cdn_cannot_be_reached() -> None:
    """/docs and /redoc load their viewers from a CDN: offline they would be blank, so each script that fails to
    load shows a line naming the CDN and the document that needs no network (issue 37)."""
    transport = httpx.ASGITransport(app=create_app(Fleet()))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        for path in ("/docs", "/redoc"):
            page = (await client.get(path)).text
            cdn_scripts = re.findall(r'<script src="https://cdn\.jsdelivr\.net/[^"]+"([^>]*)>', page)
            assert cdn_scripts and all('onerror="offline()"' in attrs for attrs in cdn_scripts), path
            assert '<p id="offline" hidden>' in page and 'href="/openapi.json"' in page, path
