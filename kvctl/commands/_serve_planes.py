"""`kvctl serve`'s event-plane options (`--dynamo-discovery`, `--nats`, `--replica-sync`), checked into the options
the planes take: apart from serve's own module, which holds its flags."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvctl.errors import UsageError

if TYPE_CHECKING:
    from kvctl.server.config_file import ModelSpec
    from kvctl.server.plane.model_cards import CardBlockSizes
    from kvctl.server.plane.replica_sync import PeerLimits
    from kvctl.server.plane.zmq_plane import ZmqOptions


def zmq_options(discovery: str, namespace: str, component: str | None, endpoint: str | None, model: str,
                 router_id: int | None, state_dir: Path, replica_sync: bool, shadow: bool, jetstream: bool,
                 advertise_host: str | None, recovery_timeout: float, recovery_max_bytes: int,
                 listen_host: str, peers: PeerLimits, max_channels: int | None,
                 block_sizes: CardBlockSizes) -> ZmqOptions:
    """`--dynamo-discovery`'s plane; --jetstream is NATS's alone."""
    from kvctl.errors import DiscoveryError
    from kvctl.server.plane.dynamo_discovery import open_discovery
    from kvctl.server.plane.zmq_plane import ZmqOptions

    if jetstream:
        raise UsageError("--jetstream needs --nats URL (Dynamo's ZMQ event plane keeps no stream)")
    try:
        store = open_discovery(discovery)
    except (ValueError, DiscoveryError) as exc:
        raise UsageError(str(exc)) from None
    if not recovery_timeout > 0:
        raise UsageError(f"--recovery-timeout must be > 0 seconds, got {recovery_timeout}")
    if replica_sync and not shadow and not store.can_register:
        raise UsageError(f"--replica-sync cannot share this router's requests through {store.url} (Dynamo counts "
                         "a DynamoWorkerMetadata only for a ready pod in its EndpointSlices): add --shadow to only "
                         "take Dynamo routers' requests, or use file: or etcd: discovery")
    return ZmqOptions(discovery=discovery, namespace=namespace, component=component, endpoint=endpoint, model=model,
                      router_id=router_id_of(router_id, state_dir), replica_sync=replica_sync, shadow=shadow,
                      advertise_host=advertise_host, recovery_timeout_s=recovery_timeout,
                      recovery_max_bytes=recovery_max_bytes, listen_host=listen_host, peer_limits=peers,
                      block_sizes=block_sizes, max_channels=max_channels)


def card_block_sizes(block_size: int | None, models: Sequence[ModelSpec]) -> CardBlockSizes:
    """Which models take their model cards' block size: all, with no --block-size, but those --config sizes."""
    from kvctl.server.plane.model_cards import CardBlockSizes

    return CardBlockSizes(block_size is None, frozenset(m.name for m in models if m.block_size))


def cards_store(discovery: str | None, jetstream: bool) -> str | None:
    """--nats's --dynamo-discovery: the store its workers' model cards are read from (the events come over NATS)."""
    from kvctl.errors import DiscoveryError
    from kvctl.server.plane.dynamo_discovery import open_discovery

    if discovery is None:
        return None
    if jetstream:
        raise UsageError("--jetstream snapshots one model's index, and --dynamo-discovery's model cards index each "
                         "model apart: give one of them", hint="drop --dynamo-discovery to follow one model")
    try:
        open_discovery(discovery)
    except (ValueError, DiscoveryError) as exc:
        raise UsageError(str(exc)) from None
    return discovery


def peer_limits(ids: str | None, reservations: int | None, tokens: int | None, replica_sync: bool) -> PeerLimits:
    """--replica-peers and the peers' caps: what --replica-sync takes from other routers."""
    from kvctl.server.plane.replica_sync import PeerLimits

    if not replica_sync and (ids is not None or reservations is not None or tokens is not None):
        raise UsageError("--replica-peers, --max-peer-reservations and --max-peer-reserved-tokens need --replica-sync")
    trusted = None
    if ids is not None:
        words = [w.strip() for w in ids.split(",") if w.strip()]
        if not words or not all(len(w) <= 20 and w.isascii() and w.isdecimal() and int(w) < 2**64 for w in words):
            raise UsageError(f"--replica-peers wants router ids (u64s) separated by commas, got {ids!r}")
        trusted = frozenset(int(w) for w in words)
    return PeerLimits(trusted, reservations, tokens)


def router_id_of(given: int | None, state_dir: Path) -> int:
    """--router-id, or the id kept in the state dir (made on first use)."""
    from kvctl.server.plane.router_id import stable_router_id

    if given is not None:
        return given
    return stable_router_id(state_dir)
