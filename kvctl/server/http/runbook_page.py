"""GET /runbook: the on-call runbook of the kvctl that is running, so an alert's `runbook_url` is an absolute link
(`http://{{ $labels.instance }}/runbook#ANCHOR`) that needs no network beyond the router it names, and always
matches that router's version."""

from __future__ import annotations

import functools
import html
import re
from pathlib import Path

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

RUNBOOK = Path(__file__).resolve().parents[3] / "docs" / "runbook.md"
"""docs/runbook.md of the source tree kvctl runs from (the README installs with `pip install -e .`)."""

_ANCHOR = re.compile(r'&lt;a id=&quot;([\w-]+)&quot;&gt;&lt;/a&gt;')
_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>kvctl runbook</title></head>
<body><pre style="white-space: pre-wrap; max-width: 120ch">{}</pre></body></html>
"""


@functools.cache
def _page(path: Path) -> str:
    """The runbook's Markdown as it is written, escaped, with its `<a id>` anchors kept so `#ANCHOR` scrolls to
    its section: readable as `less` shows it, and no renderer to trust."""
    return _PAGE.format(_ANCHOR.sub(r'<a id="\1"></a>', html.escape(path.read_text(encoding="utf-8"))))


def runbook_route(path: Path = RUNBOOK) -> Route:
    """The route; without the file (kvctl installed from a wheel), a 404 that says where the runbook is."""

    async def serve(_: Request) -> Response:
        if not path.is_file():
            return Response(f"this kvctl was installed without its docs/ folder, so it has no runbook to serve "
                            f"(looked for {path}); read docs/runbook.md in kvctl's source\n", status_code=404,
                            media_type="text/plain")
        return HTMLResponse(_page(path))

    return Route("/runbook", serve, methods=["GET"])
