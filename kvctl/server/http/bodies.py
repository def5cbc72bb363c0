"""How `kvctl serve`'s API reads its request bodies (the bodies themselves are `kvctl.http_api`'s Structs).

Apart from the handlers so that a body that does not fit is worded the same on every route (`Invalid`, 422), and
the route's body, read on every routing decision, can be timed and tested alone (benchmarks/native_bench.py).
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Iterator
from typing import Any, TypeVar, overload

import msgspec

from kvctl.core.router.scoring import KNOBS
from kvctl.core.token_json import token_ids_at_head, token_ids_from_json
from kvctl.http_api import InvalidField, RouteBody, over_u64

Body = TypeVar("Body", bound=msgspec.Struct)


class Invalid(Exception):
    """A request whose body or query does not fit its schema: answered 422 with one `InvalidField` per problem."""

    def __init__(self, *fields: InvalidField) -> None:
        super().__init__("; ".join(f.msg for f in fields))
        self.fields = list(fields)


def invalid(where: str, name: str | int | None, message: str, kind: str = "value_error") -> Invalid:
    """An `Invalid` for one field (`name`) of the body or the query (`where`), or the whole body (None)."""
    return Invalid(InvalidField(kind, [where] if name is None else [where, name], message))


_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_NAMED_FIELD = re.compile(r"^Object (?:contains unknown|missing required) field `([^`]+)`")


def _located(exc: msgspec.ValidationError) -> Invalid:
    """msgspec's error (`Expected int >= 0 - at $.worker_id`) as an `Invalid` whose `loc` names the field."""
    message, _, path = str(exc).partition(" - at `")
    loc: list[str | int] = ["body"]
    for name, index in _PATH_PART.findall(path.rstrip("`").removeprefix("$")):
        loc.append(name or int(index))
    if (named := _NAMED_FIELD.match(message)) is not None:
        loc.append(named.group(1))
    return Invalid(InvalidField("value_error", loc, message))


_decoders: dict[type, msgspec.json.Decoder[Any]] = {}


def decode_body(raw: bytes, kind: type[Body]) -> Body:
    """A request body read into its Struct; `Invalid` (422) saying what is wrong when it does not fit.

    Numbers must be JSON numbers and u64 fields are checked against 2^64 here (msgspec's bounds stop at int64)."""
    if not raw.strip():
        raise invalid("body", None, "a JSON body is required", "missing")
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        body = decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise _located(exc) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise invalid("body", None, f"body is not JSON: {exc}", "json_invalid") from None
    if over_u64(getattr(body, "worker_id", None)):
        raise invalid("body", "worker_id", "Expected `int` <= 18446744073709551615")
    return body


OVERRIDES = (*KNOBS, "overlap_score_weight", "temperature")
_ROUTE_BODY = msgspec.json.Decoder(RouteBody)
_JSON_NULL = msgspec.Raw(b"null")


def read_route_body(raw: bytes) -> tuple[RouteBody, array | None]:
    """A route request and its token ids (None: not given); msgspec.DecodeError or ValueError when invalid.

    A body that opens with its token ids (as clients send them) has them read in one pass, and only its
    other members go through msgspec; any other body, or one where that reading has any doubt (an error,
    a second `token_ids`), is read whole, so both readings agree on every body."""
    head = token_ids_at_head(raw)
    if head is not None:
        token_ids, rest = head
        try:
            body = _ROUTE_BODY.decode(rest)
        except ValueError:  # msgspec.DecodeError included; read whole below, which words the error
            pass
        else:
            if body.token_ids is msgspec.UNSET:
                return body, token_ids
    return read_route_body_whole(raw)


def read_route_body_whole(raw: bytes) -> tuple[RouteBody, array | None]:
    """`read_route_body` for any body: msgspec keeps the token ids raw, the C reader reads them."""
    body = _ROUTE_BODY.decode(raw)
    raw_ids = body.token_ids
    return body, None if raw_ids is msgspec.UNSET or raw_ids == _JSON_NULL else token_ids_from_json(raw_ids)


_INTEGER = re.compile(r"-?[0-9]+")


@overload
def int_param(value: str, where: str, name: str) -> int: ...
@overload
def int_param(value: str | None, where: str, name: str) -> int | None: ...
def int_param(value: str | None, where: str, name: str) -> int | None:
    """An integer path or query parameter (None: not given); `Invalid` (422) naming it for anything else."""
    if value is None:
        return None
    if _INTEGER.fullmatch(value) is None or len(value) > 40:
        raise invalid(where, name, f"{name} must be an integer, got {value[:40]!r}")
    return int(value)


def choice_param(value: str, name: str, choices: tuple[str, ...]) -> str:
    """A query parameter that is one of `choices`; `Invalid` (422) naming them otherwise."""
    if value not in choices:
        raise invalid("query", name, f"{name} must be one of {', '.join(choices)}, got {value[:40]!r}")
    return value


def json_content_type(value: str) -> bool:
    """application/json or application/*+json, parameters allowed: what axum's Json extractor takes."""
    mime = value.split(";", 1)[0].strip().lower()
    kind, _, subtype = mime.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def parse_events(raw: bytes, content_type: str) -> Iterator[Any]:
    """The items of a JSON object, a JSON list, or JSONL: raises ValueError when the body is none of them."""
    if "ndjson" in content_type or "jsonl" in content_type:
        for n, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
                    raise ValueError(f"line {n} is not JSON: {exc}") from None
        return
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"body is not JSON ({exc}); send a RouterEvent, a list of them, or JSONL with "
                         "Content-Type: application/x-ndjson") from None
    yield from (body if isinstance(body, list) else [body])
