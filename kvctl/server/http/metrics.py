"""`GET /metrics`: read from the router's state at scrape time, so no counter is kept twice.

Only route latency and predicted hit rate are observed as they happen (histograms); everything
else is a view of `Fleet` when Prometheus asks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvctl.core.audit.ledger import RATIO_BUCKETS
from kvctl.server.health import Health
from kvctl.server.http.loop_lag import LoopLag
from kvctl.server.http.route_protocol import Connections
from kvctl.server.ingest.streams import Streams
from kvctl.server.state import Fleet

if TYPE_CHECKING:  # a router without an event plane never loads nats-py, httpx or the planes (a quicker start)
    from typing import TypeAlias

    from kvctl.server.plane.nats_plane import EventPlane
    from kvctl.server.plane.zmq_plane import ZmqPlane

    Plane: TypeAlias = EventPlane | ZmqPlane
    """A Dynamo event plane's transport: NATS, or Dynamo's ZMQ plane."""


class FleetCollector(Collector):
    def __init__(self, fleet: Fleet, streams: Streams | None = None, plane: Plane | None = None) -> None:
        self.fleet = fleet
        self.streams = streams
        self.plane = plane

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        fleet = self.fleet
        applied = CounterMetricFamily("kvctl_kv_events_applied", "KV events applied to the index, by outcome",
                                      labels=["model", "event_type", "status"])
        blocks = GaugeMetricFamily("kvctl_index_blocks", "(worker, block) pairs held", labels=["model", "tier"])
        nodes = GaugeMetricFamily("kvctl_index_nodes", "radix nodes alive (grows when memory leaks)",
                                  labels=["model", "tier"])
        worker_blocks = GaugeMetricFamily("kvctl_worker_blocks", "device blocks a worker holds",
                                          labels=["model", "worker_id", "dp_rank"])
        decode = GaugeMetricFamily("kvctl_worker_active_decode_blocks", "blocks of in-flight requests",
                                   labels=["model", "worker_id", "dp_rank"])
        prefill = GaugeMetricFamily("kvctl_worker_active_prefill_tokens", "prompt tokens still to prefill",
                                    labels=["model", "worker_id", "dp_rank"])
        for name, state in sorted(fleet.models.items()):
            for (event_type, status), n in sorted(state.applied.items()):
                applied.add_metric([name, event_type, status], n)
            for tier, stats in state.router.index.stats().items():
                blocks.add_metric([name, tier.value], stats.blocks)
                nodes.add_metric([name, tier.value], stats.nodes)
        routes = CounterMetricFamily("kvctl_worker_routes", "routes answered with this worker",
                                     labels=["model", "worker_id", "dp_rank"])
        for row in fleet.worker_rows(0.0):
            labels = [row.model, str(row.worker_id), str(row.dp_rank)]
            worker_blocks.add_metric(labels, row.blocks)
            decode.add_metric(labels, row.active_decode_blocks)
            prefill.add_metric(labels, row.active_prefill_tokens)
            routes.add_metric(labels, row.routes)
        over_limit = CounterMetricFamily("kvctl_route_over_limit", "routes refused (429) by a cap: "
                                         "--max-request-tokens, --max-reservations, --max-reserved-tokens",
                                         labels=["limit"])
        for limit in dataclasses.asdict(fleet.limits):
            over_limit.add_metric([limit], fleet.over_limit[limit])
        all_busy = CounterMetricFamily("kvctl_route_all_busy", "routes refused (503): every worker of the model "
                                       "was busy", labels=["model"])
        for name in sorted(fleet.models):  # 0 until the first: a rate has a series to start from
            all_busy.add_metric([name], fleet.all_busy[name])
        yield from (applied, blocks, nodes, worker_blocks, decode, prefill, routes, over_limit, all_busy)
        yield from _joined(fleet)
        yield from _audit(fleet)
        if fleet.approx is not None:
            cap = GaugeMetricFamily("kvctl_index_cap_blocks", "approximate mode: --max-tree-size, the (worker, "
                                    "block) pairs the index is pruned at", labels=["model"])
            pruned = CounterMetricFamily("kvctl_index_pruned_blocks", "approximate mode: (worker, block) pairs the "
                                         "--max-tree-size cap pruned (Dynamo 1.6.1 has no cap: its index would "
                                         "still hold them)", labels=["model"])
            for name, state in sorted(fleet.models.items()):
                cap.add_metric([name], fleet.approx.max_tree_size)
                pruned.add_metric([name], state.router.approx.pruned if state.router.approx is not None else 0)
            yield from (cap, pruned)
        if self.streams is not None:
            yield from self._streams(self.streams)
        if self.plane is not None:
            yield from self._plane(self.plane)

    @staticmethod
    def _plane(plane: Plane) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        status = plane.status()
        connected = GaugeMetricFamily("kvctl_nats_connected", "1 while connected to the NATS server", labels=["url"])
        connected.add_metric([plane.options.url], 1 if plane.state == "connected" else 0)
        reconnects = CounterMetricFamily("kvctl_nats_reconnects", "reconnections to the NATS server", labels=["url"])
        reconnects.add_metric([plane.options.url], plane.reconnects)
        counts = CounterMetricFamily("kvctl_nats_messages", "event-plane messages and events, by what became of "
                                     "them (events, lost_events, stale_events, restarts, ...)", labels=["kind"])
        for kind, n in sorted(status["counts"].items()):
            counts.add_metric([kind], _u64(n))
        errors = CounterMetricFamily("kvctl_nats_decode_errors", "event-plane messages skipped, by kind",
                                     labels=["kind"])
        for kind, n in sorted(status["decode_errors"].items()):
            errors.add_metric([kind], n)
        yield from (connected, reconnects, counts, errors)

    @staticmethod
    def _streams(streams: Streams) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        labels = ["worker_id", "dp_rank", "endpoint"]
        counters: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            "messages": CounterMetricFamily("kvctl_stream_messages", "engine messages received", labels=labels),
            "gaps": CounterMetricFamily("kvctl_stream_gaps", "seq gaps seen on the live stream", labels=labels),
            "lost_batches": CounterMetricFamily("kvctl_stream_lost_batches", "batches no replay could recover",
                                                labels=labels),
            "replays_failed": CounterMetricFamily("kvctl_stream_replays_failed", "replays that timed out or came "
                                                  "back incomplete", labels=labels),
            "restarts": CounterMetricFamily("kvctl_stream_engine_restarts", "engine restarts (seq went back)",
                                            labels=labels),
            "jumps": CounterMetricFamily("kvctl_stream_seq_jumps", "seqs implausibly far ahead (over 2^32): "
                                         "applied, not counted as lost", labels=labels),
            "failures": CounterMetricFamily("kvctl_stream_failures", "times the stream died of an error (and was "
                                            "run again after a backoff)", labels=labels),
        }
        errors = CounterMetricFamily("kvctl_stream_decode_errors", "events or messages skipped, by kind",
                                     labels=[*labels, "kind"])
        gapped = GaugeMetricFamily("kvctl_stream_gapped", "1 while a lost batch leaves the index incomplete",
                                   labels=labels)
        dropped_events = CounterMetricFamily("kvctl_stream_events_dropped", "events decoded but not indexed, as "
                                             "Dynamo 1.6.1 drops them, by cause", labels=[*labels, "cause"])
        for row in streams.status():
            key = [str(row["worker"]["worker_id"]), str(row["worker"]["dp_rank"]), row["endpoint"]]
            for name, family in counters.items():
                family.add_metric(key, _u64(row[name]))
            for kind, n in sorted(row["decode_errors"].items()):
                errors.add_metric([*key, kind], _u64(n))
            for cause, n in sorted(row["events_dropped"].items()):
                dropped_events.add_metric([*key, cause], _u64(n))
            gapped.add_metric(key, 1 if row["gapped"] else 0)
        dropped = CounterMetricFamily("kvctl_queue_dropped_batches", "decoded batches dropped: writer behind",
                                      labels=["model"])
        for queue in streams.queues():
            dropped.add_metric([queue["model"]], queue["dropped_batches"])
        engines = streams.engines()
        refused = CounterMetricFamily("kvctl_engines_refused", "engine endpoints refused: the router followed "
                                      "--max-engines already", value=engines["refused"])
        running = GaugeMetricFamily("kvctl_engines", "engine endpoints followed", value=engines["running"])
        yield from (*counters.values(), errors, dropped_events, gapped, dropped, refused, running)


def _joined(fleet: Fleet) -> Iterator[CounterMetricFamily]:
    """Per worker, the router's predicted cached blocks next to those the engine reported for the same requests
    (`prefill_complete` with `cached_tokens`): one query divides each by the prompt blocks and compares."""
    labels = ["model", "worker_id", "dp_rank"]
    families = {
        "requests": CounterMetricFamily("kvctl_worker_joined_requests", "requests whose engine reported its "
                                        "cached tokens at prefill_complete", labels=labels),
        "prompt_blocks": CounterMetricFamily("kvctl_worker_joined_prompt_blocks", "prompt blocks of those requests",
                                             labels=labels),
        "predicted_blocks": CounterMetricFamily("kvctl_worker_predicted_cached_blocks", "of those, the blocks the "
                                                "router predicted cached when it chose the worker", labels=labels),
        "observed_blocks": CounterMetricFamily("kvctl_worker_observed_cached_blocks", "of those, the blocks the "
                                               "engine reported cached (cached_tokens / block size)", labels=labels),
    }
    for (model, (worker_id, dp_rank)), joined in sorted(fleet.joined.items()):
        for field, family in families.items():
            family.add_metric([model, str(worker_id), str(dp_rank)], getattr(joined, field))
    yield from families.values()


U64_MAX = (1 << 64) - 1


def _u64(n: int) -> int:
    """A counter as Prometheus clients read it: a u64 at most (Python's ints have no ceiling)."""
    return min(n, U64_MAX)


class ConnectionsCollector(Collector):
    """The client connections and what their limits (`--idle-timeout`, `--max-connections`) closed."""

    def __init__(self, connections: Connections) -> None:
        self.connections = connections

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        c = self.connections
        yield GaugeMetricFamily("kvctl_http_connections", "client connections open", value=c.open)
        yield GaugeMetricFamily("kvctl_http_connections_max", "--max-connections", value=c.max)
        yield CounterMetricFamily("kvctl_http_connections_refused", "connections answered 503 and closed at "
                                  "accept: --max-connections were open", value=c.refused)
        yield CounterMetricFamily("kvctl_http_connections_timed_out", "connections closed after --idle-timeout "
                                  "waiting on the client: idle, a half-sent request, or an answer not read",
                                  value=c.timed_out)


class Metrics:
    """One registry per app (never the process-global one): tests and embedders run several routers."""

    def __init__(self, fleet: Fleet, streams: Streams | None = None, plane: Plane | None = None,
                 connections: Connections | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(FleetCollector(fleet, streams, plane))
        self.connections = connections or Connections()
        self.registry.register(ConnectionsCollector(self.connections))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes & co: the index's memory
        self.route_seconds = Histogram(
            "kvctl_route_duration_seconds", "time to decide a route (hash, match, score, pick)", ["model"],
            buckets=(25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2), registry=self.registry)
        self.loop_lag = LoopLag(self.registry)
        self.predicted_hit = Histogram(
            "kvctl_route_predicted_hit_rate", "cached fraction of the prompt on the chosen worker", ["model"],
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=self.registry)


class HealthCollector:
    """`kvctl_input_lost_total{surface,cause}` and `kvctl_part_down{part,blocks_ready}` in /metrics."""

    def __init__(self, health: Health) -> None:
        self.health = health

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        lost = CounterMetricFamily("kvctl_input_lost", "inputs refused or dropped at an entry point, by surface "
                                   "and cause (GET /v1/status health.losses names the last one)",
                                   labels=["surface", "cause"])
        for (surface, cause), loss in sorted(self.health.losses.items()):
            lost.add_metric([surface, cause], loss.count)
        down = GaugeMetricFamily("kvctl_part_down", "1 for each part of the router that is down or incomplete now "
                                 "(GET /v1/status health.faults says why)", labels=["part", "blocks_ready"])
        for fault in self.health.faults.values():
            down.add_metric([fault.part, "true" if fault.blocks else "false"], 1)
        yield lost
        yield down


def _audit(fleet: Fleet) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
    """The decision audit's totals (docs/audit.md), labelled by model and router: "kvctl", or a Dynamo router id
    (at most `MAX_ROUTERS` of them, the rest summed as "other")."""
    labels = ["model", "router"]
    decisions = CounterMetricFamily("kvctl_audit_decisions", "routing decisions judged against the index, by "
                                    "outcome and reason", labels=[*labels, "outcome", "reason"])
    agreement = CounterMetricFamily("kvctl_audit_agreement", "routing decisions by whether kvctl's cost function "
                                    "picks the same worker", labels=[*labels, "agreement"])
    avoidable = CounterMetricFamily("kvctl_audit_avoidable_prefill_tokens", "prompt tokens cached on a candidate "
                                    "but prefilled by the pick: (best - chosen cached blocks) x block size",
                                    labels=labels)
    cacheable = CounterMetricFamily("kvctl_audit_cacheable_prefill_tokens", "prompt tokens cached on the best "
                                    "candidate of each judged decision", labels=labels)
    ratio = HistogramMetricFamily("kvctl_audit_chosen_best_ratio", "the pick's cached blocks over the best "
                                  "candidate's, where one held any", labels=labels)
    for (model, router), totals in sorted(fleet.audit.ledger.totals.items()):
        for (outcome, reason), n in sorted(totals.decisions.items()):
            decisions.add_metric([model, router, outcome, reason], n)
        for kind, n in sorted(totals.agreement.items()):
            agreement.add_metric([model, router, kind], n)
        avoidable.add_metric([model, router], totals.avoidable_tokens)
        cacheable.add_metric([model, router], totals.cacheable_tokens)
        buckets = [(f"{bound:g}", n) for bound, n in zip(RATIO_BUCKETS, totals.ratio_buckets, strict=True)]
        ratio.add_metric([model, router], [*buckets, ("+Inf", totals.ratio_count)], totals.ratio_sum)
    yield from (decisions, agreement, avoidable, cacheable, ratio)
