"""GET /runbook: the router serves its own runbook, so an alert's link is absolute and works offline (issue 37)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from starlette.applications import Starlette

from kvctl.server.http.api import create_app
from kvctl.server.http.runbook_page import RUNBOOK, runbook_route
from kvctl.server.state import Fleet


async def test_the_runbook_page_keeps_every_anchor_and_escapes_the_rest() -> None:
    transport = httpx.ASGITransport(app=create_app(Fleet(), admin_token="s3cret"))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        reply = await client.get("/runbook")  # no token: a runbook holds no secret
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/html")
    anchors = re.findall(r'<a id="([\w-]+)"></a>', RUNBOOK.read_text())
    assert len(anchors) > 5 and re.findall(r'<a id="([\w-]+)"></a>', reply.text) == anchors
    body = re.search(r"<pre[^>]*>(.*)</pre>", reply.text, re.S)[1]
    assert "<" not in re.sub(r'<a id="[\w-]+"></a>', "", body), "only the anchors are markup"


async def test_without_its_docs_the_page_says_where_the_runbook_is(tmp_path: Path) -> None:
    app = Starlette(routes=[runbook_route(tmp_path / "runbook.md")])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        reply = await client.get("/runbook")
    assert reply.status_code == 404 and "docs/runbook.md" in reply.text and str(tmp_path) in reply.text
