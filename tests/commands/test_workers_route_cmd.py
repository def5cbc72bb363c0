"""`kvctl workers` and `kvctl route` against a real router loaded with Dynamo 1.6.1's dump."""

from __future__ import annotations

import importlib.util
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.commands.live_router import (
    PROMPT,
    PROMPT_HASHES,
    WORKERS,
    json_of,
    kvctl,
    loaded_router,
    one_line_error,
)
from tests.fixtures_path import FIXTURES
from tests.server.test_serve_process import serving
from tests.support.served import on_both_route_paths
from tests.tiers.exporter import metrics_handler

TOKENS = [str(t) for t in PROMPT]


@pytest.fixture
def router(tmp_path: Path) -> Iterator[httpx.Client]:
    with loaded_router(tmp_path) as client:
        yield client


def _name(row: dict) -> str:
    return f"{row['worker_id']}:{row['dp_rank']}"


def test_workers_lists_every_rank_with_its_blocks(router: httpx.Client) -> None:
    workers = json_of(kvctl(router, "workers", "-o", "json"))["workers"]
    stats = router.get("/v1/tree/stats").json()["models"]["default"]["workers"]
    assert {_name(w): w["blocks"] for w in workers} == stats and set(stats) == WORKERS
    assert all(not w["busy"] and w["active_decode_blocks"] == 0 for w in workers)
    assert set(kvctl(router, "-o", "name", "workers").stdout.split()) == WORKERS
    assert kvctl(router, "workers", "-o", "wide").exit_code == 0


def test_workers_watch_streams_json_lines(router: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps = iter([None, KeyboardInterrupt()])

    def sleep(_: float) -> None:
        step = next(sleeps)
        if step is not None:
            raise step

    monkeypatch.setattr("kvctl.commands._watch.time.sleep", sleep)
    result = kvctl(router, "workers", "--watch", "-o", "json")
    assert result.exit_code == 0
    assert [len(json.loads(line)["workers"]) for line in result.stdout.splitlines()] == [4, 4]


@on_both_route_paths
def test_route_explain_lists_every_candidate(router: httpx.Client) -> None:
    answer = json_of(kvctl(router, "route", "--explain", "-o", "json", *TOKENS))
    by_name = {_name(c): c for c in answer["candidates"]}
    assert set(by_name) == WORKERS
    assert {n: c["overlap_blocks"] for n, c in by_name.items()} == {
        "1:0": 4, "2:1": 4, "9223372036854775815:0": 2, "2:0": 0}
    assert _name(answer) in {"1:0", "2:1"} and answer["overlap_blocks"] == answer["required_blocks"] == 4
    assert answer["reason"] == "tie_random"  # 1:0 and 2:1 hold the whole prompt: drawn, not by tree size
    assert all(c["overlap_by_tier"]["device"] == c["overlap_blocks"] for c in by_name.values())
    assert all(c["credit_by_tier"]["device"] == c["overlap_blocks"] and c["decay"] == 1.0 for c in by_name.values())
    table = kvctl(router, "route", "--explain", *TOKENS)
    assert table.exit_code == 0 and answer["reason"] in table.stdout
    assert "CREDIT BY TIER" in table.stdout and "device=4" in table.stdout and "DECAY" in table.stdout
    assert kvctl(router, "-o", "name", "route", "--explain", *TOKENS).stdout.strip() in {"1:0", "2:1"}


@on_both_route_paths
def test_tokens_from_arguments_file_stdin_or_local_hashes_agree(router: httpx.Client, tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.json"
    prompt.write_text(str(PROMPT))
    answers = [
        json_of(kvctl(router, "route", "-o", "json", *TOKENS)),
        json_of(kvctl(router, "route", "-o", "json", "--file", str(prompt))),
        json_of(kvctl(router, "route", "-o", "json", input=" ".join(TOKENS))),
        json_of(kvctl(router, "route", "-o", "json", "--local-hashes", *map(str, PROMPT_HASHES))),
    ]
    assert {(a["overlap_blocks"], a["required_blocks"]) for a in answers} == {(4, 4)}


def test_a_salt_or_an_adapter_changes_the_blocks_a_route_looks_for(router: httpx.Client) -> None:
    """The dump's blocks were stored unsalted, with no LoRA: a route under a salt or an adapter matches none."""
    plain = json_of(kvctl(router, "route", "--explain", "-o", "json", *TOKENS))["candidates"]
    assert max(c["overlap_blocks"] for c in plain) == 4
    for option in (["--cache-salt", "tenant-42"], ["--lora-name", "sql-lora"]):
        answer = json_of(kvctl(router, "route", "--explain", "-o", "json", *option, *TOKENS))
        assert [c["overlap_blocks"] for c in answer["candidates"]] == [0] * len(plain), option


@on_both_route_paths
def test_reserve_asks_first_and_with_yes_shows_as_active_load(router: httpx.Client) -> None:
    reserve = ("route", "--reserve", "--request-id", "r1", "-o", "json", *TOKENS)
    one_line_error(kvctl(router, *reserve), 2, "refusing without --yes")  # no terminal to ask on
    dry = kvctl(router, *reserve, "--dry-run")
    assert json_of(dry)["dry_run"] is True and "dry run: nothing was reserved" in dry.stderr
    assert _active_requests(router) == {}  # neither booked anything
    answer = json_of(kvctl(router, *reserve, "--yes"))
    assert answer["request_id"] == "r1"
    workers = {_name(w): w for w in json_of(kvctl(router, "workers", "-o", "json"))["workers"]}
    chosen = workers.pop(_name(answer))
    assert chosen["active_requests"] == 1 and chosen["active_decode_blocks"] == 4
    assert _active_requests(router) == {_name(answer): 1}


def _active_requests(router: httpx.Client) -> dict[str, int]:
    workers = json_of(kvctl(router, "workers", "-o", "json"))["workers"]
    return {_name(w): w["active_requests"] for w in workers if w["active_requests"]}


@pytest.mark.parametrize(("args", "needle"), [
    (["route", "--reserve", "1", "2"], "--reserve needs --request-id"),
    (["route", "--dry-run", "1", "2"], "--dry-run goes with --reserve"),
    (["route", "1", "x"], "not an integer"),
    (["route", "--", "-1"], "outside [0, 2^32)"),
    (["route", "--local-hashes", "18446744073709551616"], "outside [0, 2^64)"),
    (["route", "--text", "hi"], "--text and --tokenizer go together"),
    (["route", "--tokenizer", "gpt2", "1"], "--text and --tokenizer go together"),
    (["route", "--text", "hi", "--tokenizer", "gpt2", "1"], "--text replaces token ids"),
    (["route", "--file", "/nonexistent/prompt"], "/nonexistent/prompt"),
    (["route", "1", "--file", "/dev/null"], "not both"),
    (["route"], "the request is empty"),
    (["route", "--local-hashes", "--cache-salt", "s", "1"], "--cache-salt and --lora-name go with token ids"),
])
def test_bad_route_arguments_exit_2_with_one_line(router: httpx.Client, args: list[str], needle: str) -> None:
    one_line_error(kvctl(router, *args, input=""), 2, needle)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is not None, reason="transformers is installed")
def test_text_without_transformers_names_what_to_install(router: httpx.Client) -> None:
    one_line_error(kvctl(router, "route", "--text", "hello", "--tokenizer", "gpt2"), 2, "pip install transformers")


@on_both_route_paths
def test_route_for_an_unknown_model_is_a_server_error(router: httpx.Client) -> None:
    one_line_error(kvctl(router, "route", "--model", "nope", "1", "2"), 1, "unknown model 'nope'")


class _OtherVersion(BaseHTTPRequestHandler):
    """A router of another version: every answer is JSON that kvctl's API (kvctl/http_api.py) does not describe."""

    def do_GET(self) -> None:
        body = b'{"worker": 1, "workers": {"1": "x"}}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def other_version() -> Iterator[str]:
    with ThreadingHTTPServer(("127.0.0.1", 0), _OtherVersion) as server:
        thread = threading.Thread(target=server.serve_forever)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            thread.join()


@pytest.mark.parametrize(("args", "call"), [(["route", "1", "2", "-m", "default"], "POST /v1/route"),
                                            (["workers"], "GET /v1/workers")])
def test_an_answer_of_another_shape_is_one_line_naming_the_call(other_version: str, args: list[str], call: str) -> None:
    one_line_error(kvctl(other_version, *args), 1, f"{call}: the router's answer is not what kvctl ")


def test_a_route_says_when_the_frontends_router_queue_would_hold_it(tmp_path: Path) -> None:
    """Given Dynamo's queue flags, every route says whether the frontend would queue it: each rank of the pool over
    the threshold (0: any prefill in flight) times its max batched tokens. kvctl still answers at once."""
    with serving(tmp_path, "--router-queue-threshold", "0", "--router-queue-policy", "wspt") as (_, client):
        for worker_id in (1, 2):
            client.post("/v1/workers", json={"worker_id": worker_id})
        idle = json_of(kvctl(client, "route", "-o", "json", *TOKENS))
        assert "queued" not in idle
        for request_id in ("a", "b"):  # the second goes to the other worker: the first's prefill costs it
            kvctl(client, "route", "--reserve", "--request-id", request_id, "--yes", *TOKENS)
        loaded = kvctl(client, "route", "-o", "json", *TOKENS)
        assert json_of(loaded)["queued"] == {"policy": "wspt", "threshold": 0.0, "over": {
            "1:0": "active_prefill_tokens_frac 64 > 0", "2:0": "active_prefill_tokens_frac 64 > 0"},
            "policy_class": "default", "threshold_tokens": None}  # the flags' one class
        assert "warning: Dynamo's frontend would hold this request in its router queue (class default, policy " \
               "wspt): each of the pool's 2 ranks has more prefill tokens in flight than 0 x its max batched " \
               "tokens" in loaded.stderr
        client.post("/v1/requests/a/prefill_complete")
        assert "queued" not in json_of(kvctl(client, "route", "-o", "json", *TOKENS))


CLASSES = """\
default_policy_family: standard
uncached_isl_buckets: [{min_tokens: 0, bucket: short}, {min_tokens: 32, bucket: long}]
policy_classes:
  - {name: quick, policy_family: standard, cache_bucket: short, quantum: 1, prefill_busy_threshold: 500}
  - {name: bulk, policy_family: standard, cache_bucket: long, queue_policy: wspt, quantum: 4,
     prefill_busy_threshold: 50}
"""


def test_a_route_names_the_policy_class_that_would_hold_it(tmp_path: Path) -> None:
    """`--router-policy-config`'s classes were read and ignored (issue 38): a frontend given them queued while kvctl
    said nothing. Each route now falls in its class by its uncached tokens, and says when that class would hold it."""
    policy = tmp_path / "classes.yaml"
    policy.write_text(CLASSES)
    with serving(tmp_path / "state", "--router-policy-config", str(policy)) as (_, client):
        for worker_id in (1, 2):
            client.post("/v1/workers", json={"worker_id": worker_id})
        for request_id in ("a", "b"):
            kvctl(client, "route", "--reserve", "--request-id", request_id, "--yes", *TOKENS)
        loaded = kvctl(client, "route", "-o", "json", *TOKENS)  # 64 uncached tokens: class bulk, over 50 each
        assert json_of(loaded)["queued"] == {"policy": "wspt", "threshold": None, "policy_class": "bulk",
                                             "threshold_tokens": 50, "over": {"1:0": "active_prefill_tokens 64 > 50",
                                                                              "2:0": "active_prefill_tokens 64 > 50"}}
        assert "(class bulk, policy wspt)" in loaded.stderr and "than 50 tokens" in loaded.stderr
        assert "queued" not in json_of(kvctl(client, "route", "-o", "json", *TOKENS[:16]))  # quick: under 500
        modes = client.get("/v1/status").json()["modes"]["queue"]
        assert modes == {"threshold": None, "policy": "fcfs", "profiles": {"root": ["quick", "bulk"]}}


def test_with_the_frontends_metrics_a_queued_route_says_how_many_wait_ahead(tmp_path: Path) -> None:
    """Its place (issue 38): kvctl holds no queue, the frontend exports its pending requests per class. Its 1.6.1
    metrics (captured), with 3 requests of class `default` of model `tiny` pending in the decode pool's queue."""
    frontend = (FIXTURES / "dynamo-1.6.1-fleet" / "metrics" / "frontend.prom").read_text()
    pending = 'dynamo_frontend_router_queue_pending_requests{model="tiny",policy_class="default",worker_type="decode"}'
    assert f"{pending} 0\n" in frontend
    body = frontend.replace(f"{pending} 0\n", f"{pending} 3\n").encode()
    with ThreadingHTTPServer(("127.0.0.1", 0), metrics_handler(lambda: body)) as exporter, \
            serving(tmp_path, "--router-queue-threshold", "0") as (_, client):
        thread = threading.Thread(target=exporter.serve_forever)
        thread.start()
        try:
            for worker_id in (1, 2):
                client.post("/v1/workers", json={"worker_id": worker_id, "model": "tiny"})
            for request_id in ("a", "b"):
                kvctl(client, "route", "-m", "tiny", "--reserve", "--request-id", request_id, "--yes", *TOKENS)
            url = f"http://127.0.0.1:{exporter.server_address[1]}/metrics"
            loaded = kvctl(client, "route", "-m", "tiny", "--metrics", url, "-o", "json", *TOKENS)
        finally:
            exporter.shutdown()
            thread.join()
    assert json_of(loaded)["queued"]["frontend_pending"] == 3
    assert "the frontend holds 3 requests of class default now, ahead of it with fcfs and no priorities" in \
        loaded.stderr
