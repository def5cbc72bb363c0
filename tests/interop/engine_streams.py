"""The issue-43 engine streams (tests/fixtures/engine-streams/: vLLM 0.34 and SGLang 0.5.23 events written by the
engines' own code) replayed byte for byte on loopback ZMQ, and the two indexes that follow them read back alike:
Dynamo 1.6.1's standalone indexer (`GET /dump`, `POST /query`) and `kvctl serve` (`GET /v1/tree`,
`POST /v1/route`).

Each fixture line is one ZMQ message of one publisher, a (worker, dp_rank): its frames `[topic, seq, payload]` are
sent exactly as recorded. A publisher is an XPUB with `XPUB_VERBOSE`, so that every subscriber's subscription
comes up to it (a plain PUB keeps them to itself; a non-verbose XPUB passes a topic's first only): once a socket
has read one subscription per connection, with the expected number of connections up, whatever it sends next
reaches every subscriber. That is the slow-joiner barrier, with no sleep.

Worker `wK` of a stream is worker id `WORKER_BASE + K` on both sides.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from tests.fixtures_path import FIXTURES
from tests.interop.fleet import free_port

STREAMS = FIXTURES / "engine-streams"
WORKER_BASE = 1001
"""w0, w1, w2 are workers 1001, 1002, 1003."""
BLOCK_SIZE = 16
TIERS = ("device", "host_pinned", "disk", "external")
U64 = 1 << 64

Key = tuple[int, int]
"""(worker_id, dp_rank)"""


def stream_files() -> list[Path]:
    """Every stream of both engines (10 files), vLLM's first."""
    return sorted(STREAMS.glob("vllm-*/*.jsonl")) + sorted(STREAMS.glob("sglang-*/*.jsonl"))


def worker_id(worker: int) -> int:
    return WORKER_BASE + worker


def key_name(key: Key) -> str:
    return f"{key[0]}:{key[1]}"


# ----- the fixture -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Message:
    worker: int
    dp_rank: int
    seq: int
    frames: tuple[bytes, bytes, bytes]
    what: str
    batch: Any
    """The payload, `msgspec.msgpack.decode`d untyped: `[ts, events, dp_rank]`."""

    @property
    def key(self) -> Key:
        return worker_id(self.worker), self.dp_rank

    @property
    def events(self) -> list[dict[str, Any]]:
        return list(self.batch[1])


@dataclass(frozen=True)
class Prompt:
    """A query: its token ids, and the LoRA and cache salt it is asked with (None: without)."""

    name: str
    token_ids: tuple[int, ...]
    lora_name: str | None = None
    cache_salt: str | None = None

    @property
    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in (("lora", self.lora_name), ("salt", self.cache_salt)) if v)
        return f"{self.name}{extra}"


@dataclass
class Stream:
    path: Path
    messages: list[Message]
    manifest: dict[str, Any]

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def keys(self) -> list[Key]:
        """The publishers, (worker id, dp rank), in order of first appearance."""
        return list(dict.fromkeys(m.key for m in self.messages))

    def last_seq(self) -> dict[Key, int]:
        return {m.key: m.seq for m in self.messages}

    def sentinels(self) -> dict[Key, int]:
        """Each publisher's sentinel block: the one engine hash (mod 2^64) its last message stores (in each of its
        KV cache groups, v2 and v3: the same hash)."""
        last = {m.key: m for m in self.messages}
        out = {}
        for key, message in last.items():
            hashes = {h % U64 for e in message.events for h in e["block_hashes"]}
            stores_only = {e["type"] for e in message.events} == {"BlockStored"}
            assert stores_only and len(hashes) == 1, (self.name, message.what)
            out[key] = hashes.pop()
        return out

    def stores(self) -> Iterator[tuple[Message, dict[str, Any]]]:
        for message in self.messages:
            for event in message.events:
                if event.get("type") == "BlockStored":
                    yield message, event

    def prompts(self) -> list[Prompt]:
        """Prompt A, each worker's sentinel (its first 16 tokens: the lookahead and EAGLE sentinels list 17), and
        the tokens of any root store that starts with neither (s1's LoRA prompt); each asked without and with
        every LoRA name and every cache salt the stream's stores carry."""
        a = tuple(self.manifest["prompt_A_token_ids"])
        base = [Prompt("A", a)]
        for worker, tokens in sorted(self.manifest["sentinel_token_ids"].items()):
            base.append(Prompt(f"sentinel {worker}", tuple(tokens[:BLOCK_SIZE])))
        starts = {p.token_ids[:BLOCK_SIZE] for p in base}
        for message, event in self.stores():
            tokens = flat_tokens(event["token_ids"])
            if event.get("parent_block_hash") is None and tokens[:BLOCK_SIZE] not in starts:
                starts.add(tokens[:BLOCK_SIZE])
                full = len(tokens) // BLOCK_SIZE * BLOCK_SIZE
                base.append(Prompt(f"w{message.worker} seq {message.seq}", tokens[:full]))
        loras = sorted({e["lora_name"] for _, e in self.stores() if e.get("lora_name")})
        salts = sorted({e["cache_salt"] for _, e in self.stores() if e.get("cache_salt")} | {
            key.removeprefix(DYNAMO_SALT) for _, e in self.stores() for key in (e.get("extra_keys") or [None])[0] or ()
            if isinstance(key, str) and key.startswith(DYNAMO_SALT)})
        return [Prompt(p.name, p.token_ids, lora, salt)
                for p in base for lora in [None, *loras] for salt in [None, *salts]]


DYNAMO_SALT = "dynamo-cache-salt:"
"""How Dynamo's vLLM worker tags the salt it hands vLLM, which keys a request's first block with it (v7)."""


def flat_tokens(token_ids: Sequence[Any]) -> tuple[int, ...]:
    """The raw tokens of a store: EAGLE's `[t_i, t_i+1]` pairs as t_0 … t_n (n pairs, n + 1 tokens)."""
    if token_ids and isinstance(token_ids[0], list | tuple):
        return (*(pair[0] for pair in token_ids), token_ids[-1][1])
    return tuple(token_ids)


def load_stream(path: Path) -> Stream:
    messages = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        payload = bytes.fromhex(row["payload_hex"])
        frames = (bytes.fromhex(row["topic_hex"]), bytes.fromhex(row["seq_hex"]), payload)
        messages.append(Message(row["worker"], row["dp_rank"], int.from_bytes(frames[1], "big"), frames, row["what"],
                                msgspec.msgpack.decode(payload)))
    return Stream(path, messages, json.loads((path.parent / "manifest.json").read_text()))


# ----- the publishers ----------------------------------------------------------------------------------------

@dataclass
class _Publisher:
    socket: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    endpoint: str
    handshakes: int = 0
    disconnects: int = 0
    subscriptions: list[bytes] = field(default_factory=list)

    def poll(self) -> None:
        """Take in what came since: connection events and subscription messages (never blocks)."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshakes += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self.disconnects += 1
        while self.socket.poll(0):
            self.subscriptions.append(self.socket.recv())

    def joined(self, subscribers: int) -> bool:
        """`subscribers` connections up, and each connection made so far has sent its subscription (each
        subscriber subscribes to one topic, `""`)."""
        subscribed = sum(1 for s in self.subscriptions if s[:1] == b"\x01")
        return self.handshakes - self.disconnects == subscribers and subscribed >= self.handshakes

    def state(self) -> str:
        return (f"{self.endpoint}: {self.handshakes} handshakes, {self.disconnects} disconnects, "
                f"subscriptions {self.subscriptions}")


class Publishers:
    """One XPUB per publisher (worker, dp rank) of a stream, each on its own loopback port."""

    def __init__(self, keys: Iterable[Key]) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.by_key: dict[Key, _Publisher] = {}
        try:
            for key in keys:
                sock = self.context.socket(zmq.XPUB)
                sock.setsockopt(zmq.XPUB_VERBOSE, 1)
                sock.setsockopt(zmq.LINGER, 0)
                monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
                endpoint = self._bind(sock)
                self.by_key[key] = _Publisher(sock, monitor, endpoint)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _bind(sock: zmq.Socket[bytes]) -> str:
        while True:
            endpoint = f"tcp://127.0.0.1:{free_port()}"
            try:
                sock.bind(endpoint)
            except zmq.ZMQError:  # taken between the pick and the bind
                continue
            return endpoint

    def endpoints(self) -> dict[Key, str]:
        return {key: p.endpoint for key, p in self.by_key.items()}

    def joined(self, subscribers: int) -> bool:
        for publisher in self.by_key.values():
            publisher.poll()
        return all(p.joined(subscribers) for p in self.by_key.values())

    def state(self) -> str:
        return "\n".join(f"{key_name(k)} {p.state()}" for k, p in self.by_key.items())

    def send(self, message: Message) -> None:
        self.by_key[message.key].socket.send_multipart(message.frames)

    def close(self) -> None:
        for publisher in self.by_key.values():
            publisher.socket.disable_monitor()
            publisher.monitor.close(0)
            publisher.socket.close(0)
        self.context.term()


# ----- reading the indexes -----------------------------------------------------------------------------------

Blocks = dict[tuple[int, int, str], list[int]]
"""(worker id, dp rank, tier) → the engine hashes of the blocks a dump lists. A block several workers hold in the
tree is listed for each under one engine hash, that of the worker whose store made it (v1: w2 stores prompt A
under other engine hashes than w0, its lookahead tokens being in them): count them, and look up only blocks
no other worker holds (the sentinels)."""


def blocks_of(router_events: Iterable[Mapping[str, Any]]) -> Blocks:
    """The blocks a dump holds (Dynamo's `/dump` events or kvctl's `/v1/tree`: both RouterEvents, stores only)."""
    out: Blocks = defaultdict(list)
    for event in router_events:
        data = event["event"]["data"]
        stored = data.get("stored") if isinstance(data, dict) else None
        if stored:
            key = (event["worker_id"], event["event"].get("dp_rank", 0), event.get("storage_tier", "device"))
            out[key].extend(block["block_hash"] for block in stored["blocks"])
    return dict(out)


def dynamo_dump(url: str) -> list[dict[str, Any]]:
    """Every RouterEvent of the indexer's `/dump` (all its models and routing groups)."""
    dump = httpx.get(f"{url}/dump", timeout=10).json()
    return [event for group in dump.values() for event in group["events"]]


def kvctl_dump(url: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{url}/v1/tree", timeout=10)
    answer.raise_for_status()
    return answer.json()


Overlap = tuple[int, int, int]
"""Blocks matched: on device; through device then host; through device, host, then disk and external (Dynamo's
`/query` `instances` `gpu`, `cpu`, `disk`, cumulative, in blocks)."""


def dynamo_overlaps(url: str, prompt: Prompt, keys: Sequence[Key]) -> tuple[dict[Key, Overlap], Any]:
    """Dynamo's `/query` answer as `Overlap`s per (worker, dp rank) of `keys` (0 where it names none), and the
    answer itself. Its `scores` give the device overlap per (worker, dp rank), in tokens; its `instances` the
    cumulative tiers per worker (the highest over the worker's ranks: every worker here has one rank)."""
    body: dict[str, Any] = {"token_ids": list(prompt.token_ids), "model_name": "default"}
    if prompt.lora_name is not None:
        body["lora_name"] = prompt.lora_name
    if prompt.cache_salt is not None:
        body["cache_salt"] = prompt.cache_salt
    answer = httpx.post(f"{url}/query", json=body, timeout=10)
    answer.raise_for_status()
    doc = answer.json()
    out = {}
    for wid, dp in keys:
        device = doc["scores"].get(str(wid), {}).get(str(dp), 0)
        instance = doc["instances"].get(str(wid), {})
        ranks = {r for w, r in keys if w == wid}
        assert len(ranks) == 1 or not instance, f"worker {wid} has ranks {ranks}: `instances` is per worker"
        out[(wid, dp)] = (device // BLOCK_SIZE, instance.get("cpu", device) // BLOCK_SIZE,
                          instance.get("disk", device) // BLOCK_SIZE)
    return out, doc


def kvctl_overlaps(url: str, prompt: Prompt, keys: Sequence[Key]) -> tuple[dict[Key, Overlap] | str, Any]:
    """kvctl's `/v1/route` (`explain`) candidates as `Overlap`s per (worker, dp rank) of `keys` (host and disk
    made cumulative: its `overlap_by_tier` counts how far each tier continues past the faster ones, external
    as disk), and the answer; the status and body instead of the overlaps when it does not answer 200."""
    body: dict[str, Any] = {"token_ids": list(prompt.token_ids), "explain": True}
    if prompt.lora_name is not None:
        body["lora_name"] = prompt.lora_name
    if prompt.cache_salt is not None:
        body["cache_salt"] = prompt.cache_salt
    answer = httpx.post(f"{url}/v1/route", json=body, timeout=10)
    if answer.status_code != 200:
        return f"HTTP {answer.status_code} {answer.text[:200]}", answer.text
    doc = answer.json()
    rows = {(c["worker_id"], c["dp_rank"]): c for c in doc["candidates"]}
    out = {}
    for key in keys:
        row = rows.get(key)
        if row is None:
            out[key] = (0, 0, 0)
            continue
        tiers = row["overlap_by_tier"]
        device = row["overlap_blocks"]
        host = device + tiers.get("host_pinned", 0)
        out[key] = (device, host, host + tiers.get("disk", 0) + tiers.get("external", 0))
    return out, doc


def kvctl_settled(status: Mapping[str, Any], last_seq: Mapping[Key, int]) -> bool:
    """kvctl has applied every message: each stream's last seq taken in is the publisher's last, and no model's
    writer has a batch queued (a batch leaves the queue only as it is applied, on the loop that answers)."""
    streams = {(s["worker"]["worker_id"], s["worker"]["dp_rank"]): s for s in status.get("streams") or []}
    return (all(key in streams and streams[key]["last_seq"] == seq for key, seq in last_seq.items())
            and all(q["queued"] == 0 for q in status.get("queues") or []))


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """Plain columns, the last one free."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header) - 1)]
    return "\n".join("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + str(r[-1])
                     for r in [header, *rows])
