"""`kvctl serve` as a real process: prints its bound URL first, answers, snapshots, stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from kvctl.cli import app
from kvctl.server.listen import bind
from tests.fixtures_path import FIXTURES
from tests.support import eventually
from tests.support.served import on_both_route_paths

DUMP = (FIXTURES / "dynamo-1.6.1" / "dump.jsonl").read_text()


@contextmanager
def serving(state_dir: Path, *extra: str, ready: bool = True) -> Iterator[tuple[subprocess.Popen[str], httpx.Client]]:
    """A `kvctl serve` on `state_dir` and a client of it, once its port accepts and, if `ready`, once its
    restore is done (GET /readyz 200)."""
    cmd = [sys.executable, "-m", "kvctl", "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state_dir),
           "--log-level", "info", *extra]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        try:
            url = proc.stdout.readline().strip()  # type: ignore[union-attr]
            assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
            with httpx.Client(base_url=url, timeout=5) as client:
                if ready:
                    eventually(lambda: client.get("/readyz").status_code == 200, "the restore to finish")
                yield proc, client
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def refused(*args: str, timeout: float = 20) -> tuple[int, str, str]:
    """`kvctl serve ARGS` that is expected to refuse to start: (exit status, stdout, stderr)."""
    cmd = [sys.executable, "-m", "kvctl", "serve", *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return proc.returncode, out, err


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    return proc.stderr.read()  # type: ignore[union-attr]


def test_serve_answers_and_a_restart_keeps_the_index(tmp_path: Path) -> None:
    with serving(tmp_path) as (proc, client):
        assert client.get("/healthz").json()["status"] == "ok"
        first = client.get("/v1/status").json()
        assert first["rss_bytes"] > 10 * 2**20  # this very process's resident memory, not a peak or a guess
        time.sleep(0.05)
        assert client.get("/v1/status").json()["uptime_s"] >= first["uptime_s"] + 0.05
        assert client.post("/v1/workers", json={"worker_id": 5}).status_code == 201
        r = client.post("/v1/events", content=DUMP, headers={"content-type": "application/x-ndjson"})
        assert r.json()["applied"] == len(DUMP.splitlines())
        before = client.get("/v1/tree").json()
        _stop(proc)
    assert any(tmp_path.glob("state.log.*"))  # in the state log: a stop writes no image
    with serving(tmp_path) as (proc, client):
        assert client.get("/v1/tree").json() == before
        assert 5 in {w["worker_id"] for w in client.get("/v1/workers").json()["workers"]}
        log = _stop(proc)
    assert "restored" in log and "not seen" in log
    with serving(tmp_path, "--reset-states") as (proc, client):
        assert client.get("/v1/tree").json() == []
        _stop(proc)


def test_kill_9_loses_at_most_the_last_interval(tmp_path: Path) -> None:
    with serving(tmp_path, "--snapshot-interval", "0.3") as (proc, client):
        client.post("/v1/events", content=DUMP, headers={"content-type": "application/x-ndjson"})
        before = client.get("/v1/tree").json()
        time.sleep(1.0)  # at least one snapshot interval after the events
        proc.kill()
        proc.wait()
    with serving(tmp_path, "--log-format", "json") as (proc, client):
        assert client.get("/v1/tree").json() == before
        log = _stop(proc)
    entries = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert any("restored" in e["msg"] and "s ago" in e["msg"] and e["level"] == "info" for e in entries)
    assert [e for e in entries if e["level"] in ("warning", "error")] == [], "an ordinary restart warned"


@pytest.mark.parametrize(("args", "needle"), [
    (["serve", "--listen", "0.0.0.0:0"], "without --admin-token"),
    (["serve", "--listen", "7433"], "HOST:PORT"),
    (["serve", "--worker", "x=tcp://a:1"], "--worker: a worker is ID or ID:DP"),
    (["serve", "--approximate", "--jetstream", "--nats", "nats://127.0.0.1:1"],
     "--approximate indexes the router's own routes: --jetstream"),
    (["serve", "--worker", "1=tcp://127.0.0.1:1,bogus=2"], "unknown option 'bogus'"),
    (["serve", "--block-size", "0"], "--block-size must be positive"),
    (["serve", "--snapshot-interval", "0"], "--snapshot-interval must be > 0"),
    (["serve", "--state-log-backlog", "0"], "--state-log-backlog must be >= 1"),
    (["serve", "--tier-credits", "gpu=2"], "--tier-credits"),
    (["serve", "--overlap-score-credit", "-1"], "--overlap-score-credit must be a finite number >= 0"),
    (["serve", "--router-prefill-load-scale", "nan"], "--prefill-load-scale must be a finite number >= 0"),
    (["serve", "--router-policy-config", "/nonexistent.yaml"], "failed to read router policy config"),
    (["serve", "--max-engines", "1", "--worker", "1=tcp://127.0.0.1:1", "--worker", "2=tcp://127.0.0.1:2"],
     "2 engine endpoints given, past --max-engines 1"),
    (["serve", "--active-decode-blocks-threshold", "1.5"], "active_decode_blocks_threshold"),
    (["serve", "--approximate", "--router-ttl", "0"], "ttl_s"),
    (["serve", "--jetstream"], "need an event plane"),
    (["serve", "--advertise-host", "10.0.0.1"], "need an event plane"),
    (["serve", "--nats", "nats://127.0.0.1:1", "--dynamo-discovery", "file:/tmp", "--jetstream"],
     "--jetstream snapshots one model's index"),
    (["serve", "--nats", "nats://127.0.0.1:1", "--dynamo-discovery", "etc:/tmp"], "--dynamo-discovery wants"),
    (["serve", "--router-approximate-cache-policy", "lru"], "lru needs --approximate"),
    (["serve", "--dynamo-discovery", "etc:/tmp"], "--dynamo-discovery wants"),
    (["serve", "--dynamo-discovery", "etcd:127.0.0.1:2379"], "--dynamo-discovery wants"),
    (["serve", "--dynamo-discovery", "file:/tmp", "--jetstream"], "--jetstream needs --nats URL"),
    (["serve", "--dynamo-discovery", "file:/tmp", "--recovery-timeout", "0"], "--recovery-timeout must be > 0"),
    (["serve", "--nats", "nats://127.0.0.1:1", "--snapshot-threshold", "0"], "--snapshot-threshold must be positive"),
    (["serve", "--nats", "nats://127.0.0.1:1", "--nats-pending-msgs", "0"], "--nats-pending-msgs must be positive"),
    (["serve", "--nats", "nats://127.0.0.1:1", "--nats-creds", "/nonexistent.creds"], "no such file"),
])
def test_bad_serve_arguments_exit_2(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and needle in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2, result.stderr  # the error, and at most a hint


@pytest.mark.parametrize(("flag", "choices"), [
    ("--decoder", ["auto", "inline", "process"]),
    ("--log-format", ["text", "json"]),
    ("--log-level", ["debug", "info", "warning", "error", "critical"]),
])
def test_a_choice_flag_lists_its_values_and_refuses_others_on_one_line(flag: str, choices: list[str]) -> None:
    assert f"{flag} <{'|'.join(choices)}>" in CliRunner().invoke(app, ["serve", "--help"]).stdout
    result = CliRunner().invoke(app, ["serve", flag, "bogus"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"'bogus' is not one of {', '.join(map(repr, choices))}" in result.stderr and flag in result.stderr


def test_the_log_level_takes_any_case_as_before() -> None:
    result = CliRunner().invoke(app, ["serve", "--log-level", "DEBUG", "--listen", "nowhere"])
    assert result.exit_code == 2 and "--listen wants HOST:PORT" in result.stderr  # past --log-level


@pytest.mark.parametrize(("parameters", "needle"), [
    ("{overlap_score_credit: -1}", "overlap_score_credit must be finite and non-negative"),
    ("{bogus: 1}", "unknown field `bogus`"),
])
def test_a_policy_file_dynamo_refuses_exits_2_on_one_line(tmp_path: Path, parameters: str, needle: str) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("worker_selection:\n  aggregated: a\n  instances:\n    - name: a\n      type: "
                    f"dynamo-default-cost-fn\n      parameters: {parameters}\n")
    result = CliRunner().invoke(app, ["serve", "--router-policy-config", str(path)])
    assert result.exit_code == 2 and needle in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_knobs_come_from_flags_then_the_policy_file(tmp_path: Path) -> None:
    from kvctl.commands._serve_routing import router_config

    path = tmp_path / "policy.yaml"
    path.write_text("worker_selection:\n  aggregated: a\n  instances:\n    - name: a\n      type: "
                    "dynamo-default-cost-fn\n      parameters: {host_cache_hit_weight: 0.5, router_temperature: 0.2}\n")
    flags = {"host_cache_hit_weight": 0.9, "overlap_score_credit_decay": 3.0, "track_prefill_tokens": False}
    config, queues = router_config(flags, 2.0, None, path, None)
    assert queues is None  # no queue flag, no profile in the file: nothing queues
    assert (config.host_cache_hit_weight, config.router_temperature, config.overlap_score_credit_decay,
            config.prefill_load_scale, config.track_prefill_tokens) == (0.5, 0.2, 3.0, 2.0, False)
    assert config.booked_tier_weights == (0.9, 0.25)  # Dynamo books with the router-wide weights
    legacy, _ = router_config({}, 0.0, "host_pinned=0.5", None, None)
    assert (legacy.overlap_score_credit, legacy.host_cache_hit_weight, legacy.disk_cache_hit_weight) == (0, 0.5, 0.25)


def test_snapshot_header_is_versioned(tmp_path: Path) -> None:
    with serving(tmp_path, "--snapshot-interval", "0.02", "--compact-log-bytes", "0") as (proc, client):
        client.post("/v1/events", content=DUMP, headers={"content-type": "application/x-ndjson"})
        eventually(lambda: client.get("/v1/status").json()["restore"]["log"], "the image compacted",
                   until=lambda log: log["compactions"] >= 1)  # since_image is also 0 before the first write
        _stop(proc)
    data = (tmp_path / "snapshot.jsonl").read_bytes()
    last = data.rstrip(b"\n").rsplit(b"\n", 1)[1]
    header, trailer = json.loads(data.split(b"\n", 1)[0]), json.loads(last)
    assert header["schema"] == "kvctl.snapshot/v3" and header["models"] == {"default": 16}
    assert trailer["end"]["bytes"] == len(data) - len(last) - 1 and len(trailer["end"]["sha256"]) == 64


@on_both_route_paths
def test_router_knobs_and_approximate_mode(tmp_path: Path) -> None:
    tokens = list(range(64))
    with serving(tmp_path, "--approximate", "--active-prefill-tokens-threshold", "1000",
                 "--overlap-score-weight", "2") as (proc, client):
        thresholds = client.get("/busy_threshold").json()["thresholds"]
        assert thresholds[0]["active_prefill_tokens_threshold"] == 1000
        for worker_id in (1, 2):
            client.post("/v1/workers", json={"worker_id": worker_id})
        first = client.post("/v1/route", json={"token_ids": tokens, "request_id": "a", "reserve": True}).json()
        client.delete("/v1/requests/a")
        again = client.post("/v1/route", json={"token_ids": tokens, "explain": True}).json()
        assert again["worker_id"] == first["worker_id"] and again["overlap_blocks"] == 4  # learned, no events
        chosen = next(c for c in again["candidates"] if c["worker_id"] == first["worker_id"])
        assert chosen["logit"] == 2 * 0 + 4  # weight 2 x no prefill + 4 new decode blocks
        assert client.post("/v1/events", json=[]).status_code == 409
        _stop(proc)


def test_config_file_declares_models_and_workers(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text('[[models]]\nname = "llama"\nblock_size = 32\nactive_prefill_tokens_threshold = 5000\n\n'
                      '[[workers]]\nworker_id = 9\ndp_rank = 1\nendpoint = "tcp://127.0.0.1:1"\nmodel = "llama"\n')
    with serving(tmp_path, "--config", str(config)) as (proc, client):
        stats = client.get("/v1/tree/stats").json()["models"]
        assert stats["llama"]["block_size"] == 32 and stats["default"]["block_size"] == 16
        workers = client.get("/v1/workers").json()["workers"]
        assert [(w["worker_id"], w["dp_rank"], w["model"]) for w in workers] == [(9, 1, "llama")]
        by_model = {t["model"]: t for t in client.get("/busy_threshold").json()["thresholds"]}
        assert by_model["llama"]["active_prefill_tokens_threshold"] == 5000
        _stop(proc)


def test_config_file_sets_router_knobs_per_model(tmp_path: Path) -> None:
    from kvctl.server.config_file import load

    config = tmp_path / "serve.toml"
    config.write_text('[[models]]\nname = "m"\nprefill_load_scale = 2\ntrack_prefill_tokens = false\n'
                      'temperature = 0.5\n')
    assert load(config).models[0].router == {"prefill_load_scale": 2, "track_prefill_tokens": False,
                                              "temperature": 0.5}


def test_a_rendered_config_file_loads_back_the_same(tmp_path: Path) -> None:
    from kvctl.server.config_file import ModelSpec, ServeFile, load, render
    from kvctl.server.worker_info import WorkerInfo

    models = [ModelSpec('q"uoted', 32, {"prefill_load_scale": 2.5, "track_prefill_tokens": False},
                        {"active_prefill_tokens_threshold": 5000}), ModelSpec("plain")]
    workers = [WorkerInfo(1, 0, 'q"uoted', endpoint="tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558"),
               WorkerInfo(2**64 - 1, 3, "plain", endpoint="tcp://[::1]:1", topic="kv@2")]
    config = tmp_path / "serve.toml"
    config.write_text(render(ServeFile(models, workers)))
    loaded = load(config)
    assert loaded.models == models
    fields = ("worker_id", "dp_rank", "model", "endpoint", "replay_endpoint", "topic")
    assert [[getattr(w, f) for f in fields] for w in loaded.workers] == [[getattr(w, f) for f in fields]
                                                                         for w in workers]


@pytest.mark.parametrize(("text", "needle"), [
    ('[[models]]\nname = "m"\nblock_sise = 3\n', "unknown key 'block_sise'"),
    ('[[models]]\nname = "m"\nactive_decode_blocks_threshold = 2.0\n', "active_decode_blocks_threshold"),
    ('[[workers]]\nworker_id = 1\n', "missing 'endpoint'"),
    ('[[models]]\nname = "m"\noverlap_score_credit = -1\n', "overlap_score_credit must be a finite number >= 0"),
    ('[[models]]\nname = "m"\ntrack_prefill_tokens = 1\n', "track_prefill_tokens must be true or false"),
    ("[serve]\nx = 1\n", "unknown section 'serve'"),
    ('decoder = "inline"\n', "unknown section 'decoder'"),  # the choice flags have no config-file keys
    ("models = [", "serve.toml"),
])
def test_bad_config_file_exits_2_naming_the_key(tmp_path: Path, text: str, needle: str) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(text)
    result = CliRunner().invoke(app, ["serve", "--config", str(config), "--state-dir", str(tmp_path)])
    assert result.exit_code == 2 and needle in result.stderr


async def test_keep_alive_answers_do_not_wait_on_nagle() -> None:
    """A listener created without IPPROTO_TCP left TCP_NODELAY off on the connections asyncio accepts from it,
    and every keep-alive answer waited ~40 ms on the client's delayed ACK. The option is asserted, not the
    time (benchmarks/serve_bench.py's health_get_p50_ms is that figure)."""
    accepted: asyncio.Queue[int] = asyncio.Queue()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.put_nowait(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(serve, sock=bind("127.0.0.1", 0))  # as uvicorn serves the router's socket
    async with server:
        _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        try:
            assert await asyncio.wait_for(accepted.get(), 10) != 0
        finally:
            writer.close()


def test_the_loop_is_probed_for_lag(tmp_path: Path) -> None:
    def probes() -> float:
        families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
        samples = {s.name: s.value for s in families["kvctl_event_loop_lag_seconds"].samples if not s.labels}
        return samples["kvctl_event_loop_lag_seconds_count"]

    with serving(tmp_path) as (proc, client):
        eventually(probes, "5 loop-lag probes", until=lambda n: n >= 5)  # a probe every 10 ms: not one at start
        _stop(proc)
