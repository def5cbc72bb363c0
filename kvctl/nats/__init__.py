"""Everything kvctl says to a NATS server, but the router's event plane (`kvctl.server.plane.nats_plane`, which
uses this package): how to connect (`connection`: the one `connect()`, whose failures are `Unreachable` in one
line), a barrier round trip, kvctl's JetStream stream and snapshot, `events publish` and the `--nats` tap.

It may import `kvctl.core`, `kvctl.errors` and the taps' shared counting (`kvctl.event_taps`); never the
server, the commands or the client, so a command loads only the NATS it needs.
"""
