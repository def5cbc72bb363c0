"""/openapi.json is generated from `kvctl.http_api`: each body's schema is its Struct's, so the document cannot
say one thing while the router sends another (schemathesis then checks every answer against it)."""

from __future__ import annotations

from typing import Any

import httpx
import msgspec

from kvctl import http_api as api
from kvctl.server.http.api import create_app
from kvctl.server.state import Fleet

REF = "#/components/schemas/{name}"


async def _document() -> dict[str, Any]:
    transport = httpx.ASGITransport(app=create_app(Fleet()))
    async with httpx.AsyncClient(transport=transport, base_url="http://kvctl") as client:
        return (await client.get("/openapi.json")).json()


def _json_schema(operation: dict[str, Any], status: str | None = None) -> Any:
    part = operation["responses"][status] if status else operation["requestBody"]
    return part["content"]["application/json"]["schema"]


async def test_every_body_is_described_by_its_struct() -> None:
    document = await _document()
    kinds = [api.Status, api.Workers, api.Worker, api.Decision, api.TreeStats, api.Error, api.Invalid,
             api.RouteBody, api.WorkerBody, api.BusyBody]
    _, expected = msgspec.json.schema_components(kinds, ref_template=REF)
    schemas = document["components"]["schemas"]
    assert {name: schemas.get(name) for name in expected} == expected
    paths = document["paths"]
    assert _json_schema(paths["/v1/status"]["get"], "200") == {"$ref": REF.format(name="Status")}
    assert _json_schema(paths["/v1/workers"]["post"], "201") == {"$ref": REF.format(name="Worker")}
    assert _json_schema(paths["/v1/workers"]["post"]) == {"$ref": REF.format(name="WorkerBody")}
    assert _json_schema(paths["/v1/route"]["post"], "429") == {"$ref": REF.format(name="Problem")}
    assert schemas["Problem"]["anyOf"] == [{"$ref": REF.format(name="Error")}, {"$ref": REF.format(name="Invalid")}]
