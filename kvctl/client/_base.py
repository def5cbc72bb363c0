"""Requests to a router, and what their answers mean, with no I/O: the sync and async clients only send.

Each API call is a `Call` (method, path, params, body) built by a function below; `interpret` turns
the response into data or into kvctl's error tree, and `translate` does the same for transport
failures. Both clients share these, so a command and the TUI can never disagree on an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from kvctl.errors import AllBusy, ApiError, KvctlError, NotFound, Refused, Unreachable, there

DEFAULT_MODEL = "default"

KEEPALIVE_EXPIRY_S = 2.0
"""How long an idle pooled connection is reused. Below uvicorn's 5 s idle timeout (the default of vLLM's
and SGLang's servers and of kvctl's own), because at equal values the server can close a connection just
as the client sends on it, and the request fails with "Server disconnected without sending a response"."""


def pool_limits(max_connections: int | None = None) -> httpx.Limits:
    return httpx.Limits(max_connections=max_connections, keepalive_expiry=KEEPALIVE_EXPIRY_S)


@dataclass(frozen=True, slots=True)
class Call:
    method: str
    path: str
    params: dict[str, Any] = field(default_factory=dict)
    json: Any = None


_ENCODER = msgspec.json.Encoder()
_JSON = {"content-type": "application/json"}


def request_args(call: Call) -> dict[str, Any]:
    """httpx's keyword arguments for a call: its query, and its body encoded with msgspec, which is ~10x faster
    than httpx's own stdlib encoding on a route call's token list (50 against 570 us for 2,176 tokens): the load
    generator makes thousands of them."""
    if call.json is None:
        return {"params": call.params}
    return {"params": call.params, "content": _ENCODER.encode(call.json), "headers": _JSON}


def interpret(call: Call, response: httpx.Response) -> Any:
    """The answer's JSON, or the error it stands for, carrying the server's own message."""
    if response.is_success:
        try:
            return msgspec.json.decode(response.content) if response.content else None
        except (ValueError, RecursionError) as exc:  # not a router (a proxy's page?), or nested too deep
            raise KvctlError(f"{call.method} {call.path}: the answer is not JSON: {exc}") from None
    try:
        body = msgspec.json.decode(response.content)
        message, models, busy = body.get("error") or body.get("detail"), body.get("models"), "tripped" in body
    except (ValueError, AttributeError, RecursionError, TypeError):
        message, models, busy = None, None, False
    text = f"{call.method} {call.path}: {message or response.reason_phrase} (HTTP {response.status_code})"
    if response.status_code == 404:  # an unknown model's answer lists the router's models: name them
        raise NotFound(text, status=404, hint=there("model", map(str, models)) if isinstance(models, list) else None)
    if response.status_code == 503:
        raise (AllBusy if busy else Refused)(text, status=503)
    if response.status_code == 401:
        raise ApiError(text, status=401, hint="pass --token (or set KVCTL_TOKEN) with the router's admin token")
    raise ApiError(text, status=response.status_code)


@contextmanager
def translate(base_url: str) -> Iterator[None]:
    """httpx's transport failures as kvctl errors naming the URL (exit 3 when unreachable). A call's deadline
    (`kvctl.client.deadline`) passing is a timeout like any other: the async client's raises TimeoutError."""
    try:
        yield
    except (httpx.TimeoutException, TimeoutError):
        raise KvctlError(f"{base_url} did not answer in time",
                         hint="raise --timeout, or check the router's load") from None
    except httpx.TransportError as exc:
        raise Unreachable(f"cannot reach the router at {base_url}: {exc or type(exc).__name__}",
                          hint="is `kvctl serve` running there? (--server / KVCTL_SERVER)") from None


def headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def verify_tls(base_url: str) -> bool:
    """Certificates are checked whenever there is TLS. A plain-http client has none (redirects are not
    followed, so it never leaves its base URL), and httpx would still load the CA bundle: ~30 ms of a
    command that should take a few hundred."""
    return base_url.startswith("https://")


# ----- the API, one function per call (docs/http-api.md) -----------------------------------------------------

def status() -> Call:
    return Call("GET", "/v1/status")


def workers() -> Call:
    return Call("GET", "/v1/workers")


def register_worker(worker_id: int, endpoint: str | None = None, *, dp_rank: int = 0,
                    replay_endpoint: str | None = None, model: str = DEFAULT_MODEL, topic: str = "") -> Call:
    return Call("POST", "/v1/workers", json={"worker_id": worker_id, "dp_rank": dp_rank, "endpoint": endpoint,
                                             "replay_endpoint": replay_endpoint, "model": model, "topic": topic})


def route(*, token_ids: list[int] | None = None, local_hashes: list[int] | None = None,
          model: str = DEFAULT_MODEL, request_id: str | None = None, reserve: bool = False,
          explain: bool = False) -> Call:
    body: dict[str, Any] = {"model": model, "reserve": reserve, "explain": explain}
    body.update({k: v for k, v in (("token_ids", token_ids), ("local_hashes", local_hashes),
                                   ("request_id", request_id)) if v is not None})
    return Call("POST", "/v1/route", json=body)


def prefill_complete(request_id: str, model: str = DEFAULT_MODEL, cached_tokens: int | None = None) -> Call:
    """Prefill done; with the prompt tokens the engine found cached, which the router joins with its prediction
    (`kvctl_worker_observed_cached_blocks_total`)."""
    return Call("POST", f"/v1/requests/{request_id}/prefill_complete", params={"model": model},
                json=None if cached_tokens is None else {"cached_tokens": cached_tokens})


def free(request_id: str, model: str = DEFAULT_MODEL) -> Call:
    return Call("DELETE", f"/v1/requests/{request_id}", params={"model": model})


def tree_stats(model: str | None = None) -> Call:
    return Call("GET", "/v1/tree/stats", params={"model": model} if model else {})


def tree(model: str = DEFAULT_MODEL, worker: str | None = None) -> Call:
    """`GET /v1/tree`: a model's index as a JSON list of RouterEvents; one worker's part (`ID` or `ID:DP`)."""
    return Call("GET", "/v1/tree", params={"model": model, **({"worker": worker} if worker else {})})


def reset(*, model: str | None = None, worker_id: int | None = None, dp_rank: int | None = None) -> Call:
    return Call("POST", "/v1/reset", json={"model": model, "worker_id": worker_id, "dp_rank": dp_rank})


def busy_thresholds() -> Call:
    """Dynamo's `GET /busy_threshold`: every model's thresholds."""
    return Call("GET", "/busy_threshold")


def set_busy_thresholds(model: str, fields: dict[str, float | int]) -> Call:
    """Dynamo's `POST /busy_threshold`: the given thresholds are merged in; only non-null fields are sent."""
    return Call("POST", "/busy_threshold", json={"model": model, **fields})


def unset_busy_thresholds(model: str, fields: list[str]) -> Call:
    """kvctl's `DELETE /busy_threshold` (a Dynamo frontend cannot unset a threshold over HTTP)."""
    return Call("DELETE", "/busy_threshold", params={"model": model, "field": fields})


def post_events(events: list[dict[str, Any]], model: str = DEFAULT_MODEL) -> Call:
    """RouterEvent objects (Python ints: exact beyond 2^53) into the router's index."""
    return Call("POST", "/v1/events", params={"model": model}, json=events)
