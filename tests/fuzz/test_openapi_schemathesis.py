"""Schemathesis against a real `kvctl serve` process: every operation of the /openapi.json it serves, with
positive (schema-valid) and negative (schema-violating) requests. No 5xx, every status documented, every response
of the documented content type and schema, and nothing in the server's log that looks like a crash.

The operations are driven through schemathesis's Python API (`operation.as_strategy()` under Hypothesis), not
its pytest plugin: the plugin's `from_fixture` loader, the one way to load a schema from a server started by a
fixture, reads `Node._nodeid`, which pytest 9 no longer has.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from kvctl.server.http.api import openapi_document
from tests.server.test_serve_process import serving

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES = 40  # per operation and mode: 16 operations, 27 runs, in about 25 s on 2 CPUs
# What the served document is checked to hold (so an operation missing from it cannot pass by not being run).
_DOCUMENT = openapi_document()
OPERATIONS = sorted((method.upper(), path) for path, item in _DOCUMENT["paths"].items() for method in item)
# Negative requests need something to get wrong: a parameter or a body.
CASES = [(method, path, mode) for method, path in OPERATIONS for mode in GenerationMode
         if mode is GenerationMode.POSITIVE or {"parameters", "requestBody"} & set(_DOCUMENT["paths"][path][
             method.lower()])]


@dataclass
class Live:
    schema: schemathesis.BaseSchema
    client: httpx.Client
    log: list[str]  # the server's stderr so far


def crashes(log: list[str]) -> list[str]:
    """Lines of the server's log that say something broke: a traceback, or anything logged as an error."""
    return [line for line in log if "Traceback" in line or " ERROR " in line or "CRITICAL" in line]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """A `kvctl serve` on a free port and the schema it serves; its stderr is read all along (a full pipe
    would stall it) and kept."""
    with serving(tmp_path_factory.mktemp("serve"), "--no-restore", "--log-level", "warning") as (proc, client):
        log: list[str] = []
        assert proc.stderr is not None
        reader = threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
        reader.start()
        yield Live(schemathesis.openapi.from_url(f"{client.base_url}/openapi.json"), client, log)
        assert proc.poll() is None, "kvctl serve died"
        assert client.get("/healthz").status_code == 200
        proc.terminate()
        assert proc.wait(15) == 0
        reader.join(5)
    assert not crashes(log), "".join(log)


def test_the_served_document_has_every_operation(live: Live) -> None:
    served = sorted((method.upper(), path) for path, item in live.schema.raw_schema["paths"].items()
                    for method in item)
    assert served == OPERATIONS and len(OPERATIONS) >= 15


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[f"{m} {p} {mode.value}" for m, p, mode in CASES])
def test_operation_conforms(live: Live, method: str, path: str, mode: GenerationMode) -> None:
    operation = live.schema[path][method]
    cases = 0
    # Whatever earlier operations left (models without workers, workers deleted, thresholds at 0), every model can
    # be routed: routing's refusal (503: no worker, or every one busy) is documented, but here a 5xx is a failure.
    for n, model in enumerate(["default", *live.client.get("/v1/tree/stats").json()["models"]]):
        worker = {"worker_id": 2**63 + n, "model": model}  # a worker is in one model: one each
        assert live.client.post("/v1/workers", json=worker).status_code == 201
        assert live.client.delete("/busy_threshold", params={"model": model}).status_code == 200

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        nonlocal cases
        cases += 1
        case.call_and_validate(checks=CHECKS)

    run()
    print(f"{method} {path} {mode}: {cases} cases")  # the counts of the report (pytest -s)
    assert cases > 0
    assert not crashes(live.log), "".join(live.log)
