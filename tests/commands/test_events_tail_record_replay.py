"""`kvctl events tail|record|replay` against a real engine PUB socket, a real nats-server and a real router."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from kvctl.core.events.dump_file import read_timed_events
from kvctl.core.events.engine import decode_engine_batch
from kvctl.core.events.engine_encode import VLLM as VLLM_FORMAT
from kvctl.core.events.engine_encode import BlockRemoved, encode_batch
from tests.doctor.test_doctor_zmq_plane import record_file
from tests.fixtures_path import FIXTURES
from tests.nats_server import NatsServer, free_port

VLLM = FIXTURES / "vllm-0.33"
PAYLOADS = [(VLLM / m["file"]).read_bytes() for m in json.loads((VLLM / "manifest.json").read_text())["messages"]]
DUMP = FIXTURES / "dynamo-1.6.1" / "dump.jsonl"


def kvctl(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "kvctl", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@contextmanager
def engine() -> Iterator[tuple[zmq.Socket, str]]:
    """A PUB socket that says when a subscriber arrived (XPUB), sending the real vLLM captures."""
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield pub, f"tcp://127.0.0.1:{port}"
    finally:
        pub.close(0)


def send(pub: zmq.Socket, seqs: list[int]) -> int:
    """Send captures a, b, c, ... with these seqs once the tail has subscribed; returns the events sent."""
    assert pub.poll(10_000), "the tail never subscribed"
    pub.recv()
    events = 0
    for seq, payload in zip(seqs, PAYLOADS, strict=False):
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        events += len(decode_engine_batch(payload, default_block_size=16).events)
    return events


def test_tail_from_an_engine_shows_events_and_the_gap() -> None:
    with engine() as (pub, endpoint):
        proc = kvctl("events", "tail", "--zmq", endpoint, "--worker-id", "7", "--duration", "3", "-o", "json")
        sent = send(pub, [0, 1, 4])  # seqs 2 and 3 never come
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    gaps = [line for line in lines if line["event"] is None]
    assert [g["missing"] for g in gaps] == [[2, 3]]
    assert sum(1 for line in lines if line["event"]) == sent
    assert {line["event"]["worker_id"] for line in lines if line["event"]} == {7}
    assert "1 gap (2 missing)" in err


def _tailed(*args: str) -> list[dict[str, Any]]:
    """The events `events tail --zmq ... -o json ARGS` shows of the captures a, b, c, sent at seqs 0, 1, 2."""
    with engine() as (pub, endpoint):
        proc = kvctl("events", "tail", "--zmq", endpoint, "--count", "1000", "--duration", "3", "-o", "json", *args)
        send(pub, [0, 1, 2])
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    return [line["event"] for line in map(json.loads, out.splitlines()) if line["event"]]


def test_tail_writes_hashes_as_strings_that_jq_16_keeps_exact() -> None:
    """Decimal numbers by default, as `tree` and `hash`; `--hash-format str` for tools that read doubles."""
    numbers, strings = _tailed(), _tailed("--hash-format", "str")
    hashes = [b["block_hash"] for e in numbers for b in e["event"]["data"].get("stored", {}).get("blocks", [])]
    assert hashes and all(isinstance(h, int) for h in hashes) and any(h > 2**53 for h in hashes)
    assert json.loads(json.dumps(strings), parse_int=str) == json.loads(json.dumps(numbers), parse_int=str)
    jq = subprocess.run(["jq", "-r", ".event.data.stored.blocks[]?.block_hash"], input="\n".join(
        json.dumps(e) for e in strings), capture_output=True, text=True, check=True)
    assert jq.stdout.split() == [str(h) for h in hashes]


@pytest.mark.parametrize(("command", "topic"), [(["tail"], ""), (["record", "rec.jsonl"], "kv@")])
def test_a_tap_that_receives_nothing_warns_and_exits_4(command: list[str], topic: str, tmp_path: Path) -> None:
    """An engine that publishes nothing (or a wrong port: ZMQ connects without complaint) was exit 0, no word."""
    with engine() as (pub, endpoint):
        proc = subprocess.run([sys.executable, "-m", "kvctl", "events", *command, "--zmq", endpoint, "--topic", topic,
                               "--duration", "1"], capture_output=True, text=True, timeout=30, cwd=tmp_path)
        assert pub.poll(0), "the tap never subscribed: the test proves nothing"
    assert proc.returncode == 4, proc.stderr
    warning = proc.stderr.splitlines()[-1]
    assert warning.startswith(f"warning: received nothing: nothing publishes at {endpoint} (wrong host or port?); "
                              "or the engine publishes no KV events"), warning
    assert ("--topic 'kv@'" in warning) is bool(topic)


def removals(count: int) -> bytes:
    """One engine message carrying `count` events (a block removed each)."""
    return encode_batch(VLLM_FORMAT, 0.0, [BlockRemoved([n + 1]) for n in range(count)])


def summary_events(err: str) -> int:
    """The event count of tail's closing summary (`N messages, M events, ...`)."""
    found = re.search(r"(\d+) events?,", err.splitlines()[-1])
    assert found, err
    return int(found.group(1))


@pytest.mark.parametrize("command", [["tail", "-o", "json"], ["record", "rec.jsonl", "-o", "json"]])
def test_count_stops_inside_a_message_counting_only_what_it_shows(command: list[str], tmp_path: Path) -> None:
    """`-n 3` of a 5-event message showed 3 and counted 4: the tap had counted the event it was closed at."""
    with engine() as (pub, endpoint):
        proc = subprocess.Popen([sys.executable, "-m", "kvctl", "events", *command, "--zmq", endpoint, "-n", "3",
                                 "-d", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        assert pub.poll(10_000), "the tap never subscribed"
        pub.recv()
        pub.send_multipart([b"", (0).to_bytes(8, "big"), removals(5)])
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    if command[0] == "tail":
        assert len(out.splitlines()) == summary_events(err) == 3, (out, err)
    else:
        assert len((tmp_path / "rec.jsonl").read_text().splitlines()) == json.loads(out)["events"] == 3, out


def test_what_came_before_the_duration_is_shown_whole_however_slow_the_reader(tmp_path: Path) -> None:
    """17 lines against a summary of 18: an event received before --duration ran out, shown after it, was dropped.
    Here the reader is slow by construction: the tail's stdout (a pipe nobody reads) fills up in the middle of a
    message received at once, and is read only once the deadline has surely passed."""
    events, duration = 3000, 2.0  # 3000 JSON lines: several times a pipe's 64 KiB
    with engine() as (pub, endpoint), kvctl("events", "tail", "--zmq", endpoint, "--duration", str(duration),
                                            "-o", "json") as proc:
        assert pub.poll(10_000), "the tail never subscribed"
        pub.recv()
        subscribed = time.monotonic()  # after the tail set its deadline
        pub.send_multipart([b"", (0).to_bytes(8, "big"), removals(events)])
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()  # received: it shows the first event, then blocks on the full pipe
        assert first
        time.sleep(max(0.0, subscribed + duration - time.monotonic()) + 0.2)
        out = first + proc.stdout.read()  # what readline buffered too (communicate would skip it)
        err = proc.stderr.read()  # two lines: they never fill the pipe
        assert proc.wait(timeout=30) == 0, err
    assert len(out.splitlines()) == summary_events(err) == events, err


def record(path: Path, seqs: list[int]) -> int:
    """`events record PATH` of a live engine sending captures with these seqs; returns the events recorded."""
    with engine() as (pub, endpoint):
        proc = kvctl("events", "record", str(path), "--zmq", endpoint, "--worker-id", "3", "--duration", "3",
                     "-o", "json")
        sent = send(pub, seqs)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert json.loads(out)["events"] == sent
    return sent


def test_record_then_replay_into_a_router(tmp_path: Path) -> None:
    recording = tmp_path / "rec.jsonl"
    sent = record(recording, [0, 1, 2])
    timed = read_timed_events(recording.read_text())
    assert len(timed) == sent and all(ts is not None for ts, _ in timed)
    dry = kvctl("events", "replay", str(recording), "--dry-run", "-o", "json")  # says what it would send (issue 37)
    out, err = dry.communicate(timeout=30)
    assert dry.returncode == 0 and json.loads(out)["would_send"] == {"events": sent, "workers": ["3:0"],
                                                                   "decisions": 0, "seconds": 0.0}, err
    assert f"dry run, nothing sent: would send {sent} events of 1 worker (3:0)" in err
    with serve(tmp_path) as url:
        replay = kvctl("--server", url, "events", "replay", str(recording), "--yes", "-o", "json")
        out, err = replay.communicate(timeout=30)
        assert replay.returncode == 0, err
        assert json.loads(out) == {"source": str(recording), "sent": sent, "applied": sent, "rejected": {},
                                   "dry_run": False, "decisions": {"sent": 0, "audited": 0, "booked": {},
                                                                   "rejected": {}}}
        assert httpx.get(f"{url}/v1/tree/stats").json()["models"]["default"]["workers"]["3:0"] > 0


def replay(url: str, path: Path, *args: str) -> tuple[int, str, str]:
    proc = kvctl("--server", url, "events", "replay", str(path), "--yes", *args)
    out, err = proc.communicate(timeout=30)
    return proc.returncode, out, err


def test_a_recording_that_starts_mid_stream_exits_1_saying_why(tmp_path: Path) -> None:
    """It was "0 applied", a Python dict of reasons in the table, and exit 0. Real events, recorded from an engine;
    the first (the stored blocks the rest build on) cut off, as when recording starts after the engine did."""
    recording = tmp_path / "rec.jsonl"
    record(recording, [0, 1, 2, 3, 4, 5])  # 0: stored at the root; 1: stored under 0's blocks; ...; 3: cleared
    lines = recording.read_text().splitlines(keepends=True)
    nothing, some = tmp_path / "nothing.jsonl", tmp_path / "some.jsonl"
    nothing.write_text("".join(lines[1:4]))  # capture 1's store and capture 2's removals: all need capture 0
    some.write_text("".join(lines[1:]))
    with serve(tmp_path) as url:
        code, out, err = replay(url, nothing)
        assert code == 1 and err.count("\n") == 1, err
        assert err.startswith("error: 0 of 3 events applied, 3 rejected (the recording starts mid-stream: ")
        assert "record from the engine's start" in err and "--allow-partial" not in err
        assert "{" not in out
        assert re.search(r"^parent_block_not_found +1$", out, re.M) and re.search(r"^block_not_found +2$", out, re.M)
        assert replay(url, nothing, "--allow-partial")[0] == 1  # nothing applied: --allow-partial cannot help

        code, out, err = replay(url, some, "-o", "json")
        summary = json.loads(out)
        assert code == 1 and 0 < summary["applied"] < summary["sent"] == len(lines) - 1, err
        assert summary["rejected"]["parent_block_not_found"] == 1
        assert err.endswith("or pass --allow-partial)\n") and err.count("\n") == 1, err

        code, out, err = replay(url, some, "--allow-partial", "-o", "json")
        assert code == 0 and json.loads(out)["applied"] == summary["applied"]
        assert err == f"warning: {summary['applied']} of {summary['sent']} events applied, " \
                      f"{summary['sent'] - summary['applied']} rejected\n"

        own_parent = tmp_path / "own_parent.jsonl"  # another cause: a block that is its own parent
        own_parent.write_text(json.dumps({"worker_id": 3, "event": {"event_id": 1, "data": {"stored": {
            "parent_hash": 11, "blocks": [{"block_hash": 11, "tokens_hash": 22}]}}}}) + "\n")
        code, out, err = replay(url, own_parent)
        assert code == 1 and re.search(r"^invalid_block +1$", out, re.M), out
        assert err == "error: 0 of 1 events applied, 1 rejected (the reasons are in the output)\n"


def test_replay_without_a_terminal_or_yes_refuses(tmp_path: Path) -> None:
    proc = kvctl("events", "replay", str(DUMP))
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and "--yes" in err


@pytest.mark.parametrize("args", [(), ("--zmq", "tcp://127.0.0.1:1", "--dynamo-discovery", "file:/tmp")])
def test_tail_needs_exactly_one_source(args: tuple[str, ...]) -> None:
    proc = kvctl("events", "tail", *args)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and "exactly one source" in err and "--dynamo-discovery" in err


def test_tail_of_a_discovery_store_not_there_is_one_line_and_exit_3() -> None:
    proc = kvctl("events", "tail", "--dynamo-discovery", f"etcd:http://127.0.0.1:{free_port()}", "--duration", "5")
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 3 and err.startswith("error: cannot read discovery etcd:http://127.0.0.1:"), err
    assert len(err.strip().splitlines()) <= 2, err  # the error, and at most a hint


@pytest.mark.parametrize("publishers", [0, 1])
def test_tail_of_a_discovery_store_that_hears_nothing_says_whether_it_found_publishers(
        tmp_path: Path, publishers: int) -> None:
    """It said "no publisher is registered, or none is publishing" with 2 publishers found on an idle fleet."""
    store = tmp_path / "discovery"
    store.mkdir()
    with zmq.Context() as ctx, ctx.socket(zmq.PUB) as pub:  # a real publisher that has nothing to say
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        if publishers:
            record_file(store, "kv-events", 0x11, f"tcp://127.0.0.1:{port}")
        proc = kvctl("events", "tail", "--dynamo-discovery", f"file:{store}", "--duration", "1")
        _, err = proc.communicate(timeout=20)
    warning = err.splitlines()[-1]
    assert proc.returncode == 4 and warning.startswith("warning: received nothing: "), err
    if publishers:
        assert "the 1 publisher found published nothing" in warning and "send it a request" in warning
    else:
        assert "no publisher of this --namespace/--component/--endpoint is registered" in warning


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path / "nats")
    yield srv
    srv.stop()


def test_tail_from_a_nats_event_plane(nats_server: NatsServer) -> None:
    tail = kvctl("events", "tail", "--nats", nats_server.url, "--namespace", "tailns", "--count", "7",
                 "--duration", "20", "-o", "json")
    assert tail.stderr is not None
    assert tail.stderr.readline().startswith(
        "listening on namespace.tailns.component.*.endpoint.*.kv-events")
    publish = kvctl("events", "publish", str(DUMP), "--nats", nats_server.url, "--namespace", "tailns", "--yes")
    publish.communicate(timeout=20)
    assert publish.returncode == 0
    out, err = tail.communicate(timeout=30)
    assert tail.returncode == 0, err
    events = [e for line in out.splitlines() if (e := json.loads(line)["event"]) is not None]
    assert len(events) == 7 and all(e["worker_id"] for e in events)


@contextmanager
def serve(tmp_path: Path, *extra: str, state: str = "state") -> Iterator[str]:
    """A `kvctl serve` (with `extra` options) on a fresh state dir `state` under `tmp_path`: its URL."""
    with kvctl("serve", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / state), "--no-restore",
               *extra) as proc:
        try:
            assert proc.stdout is not None
            yield proc.stdout.readline().strip()
        finally:
            proc.terminate()
            proc.communicate(timeout=10)


@pytest.mark.slow
@pytest.mark.parametrize("command", [["tail"], ["record", "rec.jsonl"]])
def test_an_unreachable_event_plane_is_one_line_and_exit_3(command: list[str], tmp_path: Path) -> None:
    """It used to retry for ever, ignoring --duration and signals, with a nats-py traceback every 2 s."""
    unreachable = f"nats://127.0.0.1:{free_port()}"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kvctl", "events", *command, "--nats", unreachable,
                           "--duration", "2"], capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.startswith(f"error: cannot reach NATS at {unreachable}: ") and proc.stderr.count("\n") == 1
    assert time.monotonic() - started < 5


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["duration", signal.SIGTERM, signal.SIGINT])
def test_a_tail_ends_on_duration_or_a_signal_even_with_its_server_gone(ending: Any,
                                                                         nats_server: NatsServer) -> None:
    """The server goes away mid-tail: the tap keeps reconnecting quietly until its end, then prints its counters
    (Ctrl-C and SIGTERM end an unbounded tail as --duration does, as `--watch` and `kvctl mock` do: exit 0, or 4
    with a warning when nothing came, as here)."""
    tail = kvctl("events", "tail", "--nats", nats_server.url, *(["--duration", "4"] if ending == "duration" else []))
    assert tail.stderr is not None and tail.stderr.readline().startswith("listening on")
    nats_server.stop()
    time.sleep(2.5)  # nats-py's reconnect attempts (each printed a traceback before)
    started = time.monotonic()
    if ending != "duration":
        tail.send_signal(ending)
    _, err = tail.communicate(timeout=15)
    assert tail.returncode == 4, err  # it heard nothing: said, with the likely causes
    assert err.splitlines()[0] == "0 messages, 0 events, 0 gaps (0 missing), decode errors none"
    assert err.splitlines()[1].startswith("warning: received nothing: no worker publishes under this --namespace")
    assert len(err.splitlines()) == 2
    assert time.monotonic() - started < 3


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["duration", signal.SIGTERM])
def test_a_server_that_never_speaks_does_not_outlast_duration_or_a_signal(ending: Any) -> None:
    """It accepts the connection and says nothing: each connect attempt would wait out its 5 s timeout."""
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)  # the kernel completes the handshake; nobody ever answers
        mute.settimeout(20)
        tail = kvctl("events", "tail", "--nats", f"nats://127.0.0.1:{mute.getsockname()[1]}",
                     *(["--duration", "1"] if ending == "duration" else []))
        started = time.monotonic()
        with mute.accept()[0]:  # the tail is connecting: its signal handlers are in place
            if ending != "duration":
                tail.send_signal(ending)
            _, err = tail.communicate(timeout=30)
    assert tail.returncode == 3, err
    assert err.startswith("error: cannot reach NATS at") and err.count("\n") == 1, err
    assert time.monotonic() - started < 4
