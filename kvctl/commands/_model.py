"""The model a command reads when `-m` is not given: the context's, else the one the router implies (a router fed by
`kvctl mock --config-out` serves `mock`, not `default`), so that the commonest path never gives a silent empty
answer about a model nobody uses."""

from __future__ import annotations

import typer

from kvctl.commands._options import router_client, settings_for
from kvctl.core.names import implied_model
from kvctl.output import Output


def model_for(ctx: typer.Context, out: Output, given: str | None, server: str | None = None) -> str:
    """`given` if set; else the context's model; else the router's implied model (one `GET /v1/workers` of
    `server`, the command's router by default), with a note on stderr when the choice needs saying."""
    if given:
        return given
    configured = settings_for(ctx).model
    if configured:
        return configured
    from kvctl.client import calls

    with router_client(ctx, server) as client:
        rows = client.send(calls.workers()).workers
    by_model: dict[str, int] = {}
    for row in rows:
        by_model[row.model] = by_model.get(row.model, 0) + 1
    model, note = implied_model(by_model)
    if note:
        out.warn(note)
    return model
