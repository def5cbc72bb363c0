"""Requests to a router, and what their answers mean, with no I/O: the sync and async clients only send.

Each API call is a `Call` (method, path, params, body, and the `kvctl.http_api` Struct its answer is) built by a
function below; `interpret` turns the response into that Struct or into kvctl's error tree, and `translate` does
the same for transport failures. Both clients share these, so a command and the TUI can never disagree on an
answer or an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from kvctl import __version__
from kvctl import http_api as api
from kvctl.core.names import DEFAULT_MODEL
from kvctl.errors import AllBusy, ApiError, KvctlError, NotFound, Refused, Restoring, TimedOut, Unreachable, there

T = TypeVar("T")

KEEPALIVE_EXPIRY_S = 2.0
"""How long an idle pooled connection is reused. Below uvicorn's 5 s idle timeout (the default of vLLM's
and SGLang's servers and of kvctl's own), because at equal values the server can close a connection just
as the client sends on it, and the request fails with "Server disconnected without sending a response"."""


def pool_limits(max_connections: int | None = None) -> httpx.Limits:
    return httpx.Limits(max_connections=max_connections, keepalive_expiry=KEEPALIVE_EXPIRY_S)


@dataclass(frozen=True, slots=True)
class Request:
    """An HTTP request: a router's API call, or a dump or an engine's call, which answer no Struct of ours."""

    method: str
    path: str
    params: dict[str, Any] = field(default_factory=dict)
    json: Any = None


@dataclass(frozen=True, slots=True)
class Call(Request, Generic[T]):
    """A call of the router's API: its answer decodes into `answer`, a Struct (or a list of them) of
    `kvctl.http_api`, the module the router encodes it with."""

    answer: type[T] = field(kw_only=True)


_ENCODER = msgspec.json.Encoder()
_JSON = {"content-type": "application/json"}


def request_args(call: Request) -> dict[str, Any]:
    """httpx's keyword arguments for a call: its query, and its body encoded with msgspec, which is ~10x faster
    than httpx's own stdlib encoding on a route call's token list (50 against 570 us for 2,176 tokens): the load
    generator makes thousands of them."""
    if call.json is None:
        return {"params": call.params}
    return {"params": call.params, "content": _ENCODER.encode(call.json), "headers": _JSON}


def interpret(call: Call[T], response: httpx.Response) -> T:
    """The answer as its Struct, or the error it stands for, carrying the server's own message. An answer that
    is not JSON (a proxy's page?) or not of the Struct's shape (a router of another version) is an error that
    says which."""
    check(call, response)
    try:
        return msgspec.json.decode(response.content, type=call.answer)
    except msgspec.ValidationError as exc:
        raise KvctlError(f"{call.method} {call.path}: the router's answer is not what kvctl {__version__} "
                         f"expects: {exc}", hint="is the router another version? (GET /healthz says which)") from None
    except (ValueError, RecursionError) as exc:  # msgspec.DecodeError is a ValueError; or nested too deep
        raise KvctlError(f"{call.method} {call.path}: the answer is not JSON: {exc}") from None


def check(request: Request, response: httpx.Response) -> None:
    """Nothing for a success; else the error the answer stands for, carrying the server's own message."""
    if response.is_success:
        return
    error = _error_of(response.content)
    if isinstance(error, api.Invalid):
        message: str | None = "; ".join(f"{'.'.join(map(str, e.loc))}: {e.msg}" for e in error.detail)
    else:
        message = None if error is None else error.error
    models = error.models if isinstance(error, api.Error) and isinstance(error.models, list) else None
    busy = isinstance(error, api.Error) and not isinstance(error.tripped, msgspec.UnsetType)
    text = f"{request.method} {request.path}: {message or response.reason_phrase} (HTTP {response.status_code})"
    if response.status_code == 404:  # an unknown model's answer lists the router's models: name them
        raise NotFound(text, status=404, hint=there("model", models) if models is not None else None)
    if response.status_code == 503 and isinstance(error, api.Error) and error.restoring is not msgspec.UNSET:
        raise Restoring(text, status=503, hint="wait for GET /readyz to answer 200, then retry")
    if response.status_code == 503:
        raise (AllBusy if busy else Refused)(text, status=503)
    if response.status_code == 401:
        wrong = "authorization" in response.request.headers
        raise ApiError(text, status=401, hint="the token given (--token, KVCTL_TOKEN or the context's) is not the "
                       "router's --admin-token: check which one it was started with" if wrong else
                       "pass --token (or set KVCTL_TOKEN) with the router's admin token")
    raise ApiError(text, status=response.status_code)


def warning_of(response: httpx.Response) -> str | None:
    """The text of a router's `Warning: 299 kvctl "..."` header (sent while a restart restores its index), so
    that a command can say its answer shows part of the index; None without one."""
    value: str = response.headers.get("warning", "")
    code, _, rest = value.partition(" ")
    agent, _, text = rest.partition(" ")
    if code != "299" or agent != "kvctl" or len(text) < 2 or text[0] != '"' or text[-1] != '"':
        return None
    return text[1:-1]


def _error_of(content: bytes) -> api.Error | api.Invalid | None:
    """The router's error answer (a 422's list of invalid fields, or any other's message); None for an answer
    of another shape (a proxy's page, another server's error)."""
    try:
        body = msgspec.json.decode(content)
        if isinstance(body, dict) and "detail" in body:
            return msgspec.convert(body, api.Invalid)
        return msgspec.convert(body, api.Error)
    except (ValueError, RecursionError):  # msgspec's DecodeError and ValidationError are ValueErrors
        return None


@contextmanager
def translate(base_url: str) -> Iterator[None]:
    """httpx's transport failures as kvctl errors naming the URL (exit 3 when unreachable). A call's deadline
    (`kvctl.client.deadline`) passing is a timeout like any other: the async client's raises TimeoutError."""
    try:
        yield
    except (httpx.TimeoutException, TimeoutError):
        raise TimedOut(f"{base_url} did not answer in time",
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

def status() -> Call[api.Status]:
    return Call("GET", "/v1/status", answer=api.Status)


def workers() -> Call[api.Workers]:
    return Call("GET", "/v1/workers", answer=api.Workers)


def register_worker(worker_id: int, endpoint: str | None = None, *, dp_rank: int = 0,
                    replay_endpoint: str | None = None, model: str = DEFAULT_MODEL,
                    topic: str = "") -> Call[api.Worker]:
    return Call("POST", "/v1/workers", json={"worker_id": worker_id, "dp_rank": dp_rank, "endpoint": endpoint,
                                             "replay_endpoint": replay_endpoint, "model": model, "topic": topic},
                answer=api.Worker)


def route(*, token_ids: list[int] | None = None, local_hashes: list[int] | None = None,
          model: str = DEFAULT_MODEL, request_id: str | None = None, reserve: bool = False,
          explain: bool = False, session_id: str | None = None, lora_name: str | None = None,
          cache_salt: str | None = None) -> Call[api.Decision]:
    body: dict[str, Any] = {"model": model, "reserve": reserve, "explain": explain}
    body.update({k: v for k, v in (("token_ids", token_ids), ("local_hashes", local_hashes),
                                   ("request_id", request_id), ("session_id", session_id), ("lora_name", lora_name),
                                   ("cache_salt", cache_salt)) if v is not None})
    return Call("POST", "/v1/route", json=body, answer=api.Decision)


def prefill_complete(request_id: str, model: str = DEFAULT_MODEL,
                     cached_tokens: int | None = None) -> Call[api.PrefillCompleted]:
    """Prefill done; with the prompt tokens the engine found cached, which the router joins with its prediction
    (`kvctl_worker_observed_cached_blocks_total`)."""
    return Call("POST", f"/v1/requests/{request_id}/prefill_complete", params={"model": model},
                json=None if cached_tokens is None else {"cached_tokens": cached_tokens}, answer=api.PrefillCompleted)


def free(request_id: str, model: str = DEFAULT_MODEL) -> Call[api.Freed]:
    return Call("DELETE", f"/v1/requests/{request_id}", params={"model": model}, answer=api.Freed)


def tree_stats(model: str | None = None) -> Call[api.TreeStats]:
    return Call("GET", "/v1/tree/stats", params={"model": model} if model else {}, answer=api.TreeStats)


def tree(model: str = DEFAULT_MODEL, worker: str | None = None) -> Call[list[dict[str, Any]]]:
    """`GET /v1/tree`: a model's index as a JSON list of RouterEvents, which the core decodes
    (`decode_router_event_json`); one worker's part (`ID` or `ID:DP`)."""
    return Call("GET", "/v1/tree", params={"model": model, **({"worker": worker} if worker else {})},
                answer=list[dict[str, Any]])


def reset(*, model: str | None = None, worker_id: int | None = None, dp_rank: int | None = None) -> Call[api.Cleared]:
    return Call("POST", "/v1/reset", json={"model": model, "worker_id": worker_id, "dp_rank": dp_rank},
                answer=api.Cleared)


def busy_thresholds() -> Call[api.ThresholdsList]:
    """Dynamo's `GET /busy_threshold`: every model's thresholds."""
    return Call("GET", "/busy_threshold", answer=api.ThresholdsList)


def set_busy_thresholds(model: str, fields: dict[str, float | int]) -> Call[api.Thresholds]:
    """Dynamo's `POST /busy_threshold`: the given thresholds are merged in; only non-null fields are sent."""
    return Call("POST", "/busy_threshold", json={"model": model, **fields}, answer=api.Thresholds)


def unset_busy_thresholds(model: str, fields: list[str]) -> Call[api.Thresholds]:
    """kvctl's `DELETE /busy_threshold` (a Dynamo frontend cannot unset a threshold over HTTP)."""
    return Call("DELETE", "/busy_threshold", params={"model": model, "field": fields}, answer=api.Thresholds)


def post_events(events: list[dict[str, Any]], model: str = DEFAULT_MODEL) -> Call[api.EventsApplied]:
    """RouterEvent objects (Python ints: exact beyond 2^53) into the router's index."""
    return Call("POST", "/v1/events", params={"model": model}, json=events, answer=api.EventsApplied)


def post_decisions(decisions: list[dict[str, Any]], model: str = DEFAULT_MODEL) -> Call[api.DecisionsHeard]:
    """Other routers' decisions (`active_sequences_events` as serde JSON), heard as replica sync hears them."""
    return Call("POST", "/v1/decisions", params={"model": model}, json=decisions, answer=api.DecisionsHeard)


def audit(window_s: float, model: str | None = None, recent: int = 0, what_if: list[str] | None = None
          ) -> Call[api.Audit]:
    """`GET /v1/audit`: the decisions heard in the last `window_s`, judged against the router's index; with
    `what_if` (KNOB=VALUE items), priced again under those knobs."""
    params: dict[str, Any] = {"window": window_s, "recent": recent}
    if what_if:
        params["what_if"] = what_if
    if model:
        params["model"] = model
    return Call("GET", "/v1/audit", params=params, answer=api.Audit)


def audited_decision(request_id: str) -> Call[api.AuditedDecision]:
    return Call("GET", f"/v1/audit/{quote(request_id, safe='')}", answer=api.AuditedDecision)
