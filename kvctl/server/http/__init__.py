"""The router's HTTP side: handlers, request bodies, the route fast path, `/openapi.json` and `/metrics`."""
