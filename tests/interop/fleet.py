"""A real Dynamo 1.6.1 fleet for the interop tests, on loopback, every process stopped by its pid at the end.

Dynamo lives in its own venv (`.ci/install-dynamo`; `KVCTL_DYNAMO_VENV`, default `<repo>/.dynamo-venv`), never
in the project's. A fleet is, in start order:

- `python -m dynamo.mocker` workers (one process each), vLLM-style, with few KV blocks so that they evict and
  no simulated delays (`--speedup-ratio 0`), each serving vLLM's ZMQ event stream and replay
  (`--zmq-kv-events-ports`, `--zmq-replay-ports`) besides Dynamo's own event plane (NATS when the fleet has a
  NATS server, else Dynamo's ZMQ plane);
- optionally `python -m dynamo.indexer --threads 1` on the mockers' ZMQ streams: the reference index
  (`GET /dump`; docs/contract.md: its multi-threaded mode credits blocks wrongly);
- optionally `kvctl serve` following the same ZMQ streams and replays;
- `python -m dynamo.frontend --router-mode kv --router-replica-sync`: requests go through Dynamo's KV router.

Worker ids. A worker's id is the one Dynamo gives it: the mocker's instance id (a random u64 per process start,
often above 2^63), read from its `v1/instances` record in the file discovery store. The indexer and `kvctl serve`
are given that same id for the mocker's ZMQ stream (`ID=tcp://…`), so the three views (Dynamo's event plane and
router, the reference index, kvctl) name every worker alike and indexes can be diffed as they are. A mocker is
told which request-plane port to take (`DYN_TCP_RPC_PORT`), which is how its record is told from the others'.

Loopback: the request plane (`DYN_TCP_RPC_HOST`), the response streams (`DYN_TCP_RESPONSE_STREAM_HOST`), the
frontend's HTTP (`--http-host`) and `kvctl serve` bind 127.0.0.1. Dynamo 1.6.1 has no way to say where the mocker's
vLLM ZMQ sockets, its ZMQ event plane's sockets and the indexer's HTTP bind: they take 0.0.0.0 (the ports given
are free-picked on every interface for that reason); everything connects to them on 127.0.0.1 (the event plane's
advertised address is `DYN_EVENT_PLANE_HOST`). Nothing is downloaded: the model directory is written by
`write_model_dir`, and the hub is switched off. Each Dynamo process gets the fleet's own HOME (the frontend caches
model cards under ~/.cache/dynamo).
"""

from __future__ import annotations

import base64
import json
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
DYNAMO_VENV = Path(os.environ.get("KVCTL_DYNAMO_VENV") or REPO / ".dynamo-venv")
"""Read when this module is imported (at collection): the tests' autouse fixture clears KVCTL_* later."""
REQUIRE_INTEROP = os.environ.get("KVCTL_REQUIRE_INTEROP") == "1"

NAMESPACE, COMPONENT, ENDPOINT = "dynamo", "backend", "generate"
MODEL = "tiny"
BLOCK_SIZE = 16
KV_BLOCKS = 128
"""Per mocker: small, so that a few dozen requests make it evict."""
VOCAB = 1000
SPECIALS = ["<unk>", "<s>", "</s>"]
"""Token ids 0-2; the word `w{i}` is token id i + 3."""

START_S = 60.0
"""A Dynamo process's start on a busy 2-core machine: imports, runtime, discovery."""
STOP_S = 15.0
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

T = TypeVar("T")


# ----- Dynamo's venv -----------------------------------------------------------------------------------------

def dynamo_python() -> Path:
    """The Dynamo venv's python; skips the test when it is missing (fails it under KVCTL_REQUIRE_INTEROP=1)."""
    python = DYNAMO_VENV / "bin" / "python"
    why = None
    if not python.exists():
        why = f"no Dynamo venv at {DYNAMO_VENV}"
    else:
        probe = subprocess.run([str(python), "-c", "import dynamo._core, dynamo.mocker, dynamo.frontend"],
                               capture_output=True, text=True, timeout=60)
        if probe.returncode != 0:
            why = f"Dynamo does not import from {python}: {probe.stderr.strip().splitlines()[-1:]}"
    if why is not None:
        why += " (.ci/install-dynamo VENV makes one; KVCTL_DYNAMO_VENV names it)"
        if REQUIRE_INTEROP:
            pytest.fail(f"interop tier required (KVCTL_REQUIRE_INTEROP=1) but {why}", pytrace=False)
        pytest.skip(why)
    return python


# ----- ports, waits, processes -------------------------------------------------------------------------------

PORTS = (20000, 32767)
"""Where the fleet's ports are picked: below the kernel's ephemeral range (32768 and up on Linux), so that no
socket Dynamo binds to port 0 itself (its event-plane PUBs) can take one between our pick and its use; and
below 2**15, all Dynamo 1.6.1 accepts for a system port."""


def free_port() -> int:
    """A TCP port in `PORTS` free now on every interface (Dynamo binds some sockets to 0.0.0.0 whatever it is
    told)."""
    while True:
        port = random.randint(*PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port


class Proc:
    """A subprocess whose stdout and stderr go to `log` (stdout piped instead with `pipe_stdout`);
    stopped by its pid: SIGTERM, then SIGKILL."""

    def __init__(self, name: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None,
                 *, pipe_stdout: bool = False) -> None:
        self.name, self.argv, self.log = name, [str(a) for a in argv], log
        self._log_file = log.open("w")
        self.popen = subprocess.Popen(self.argv, env=env, text=True, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE if pipe_stdout else self._log_file,
                                      stderr=self._log_file)

    def first_line(self, timeout: float) -> str:
        """The first line the process printed on its piped stdout ('' when it printed none in time)."""
        assert self.popen.stdout is not None
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.popen.stdout.readline()), daemon=True).start()  # type: ignore[union-attr]
        try:
            return lines.get(timeout=timeout).strip()
        except queue.Empty:
            return ""

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 25) -> str:
        try:
            text = _ANSI.sub("", self.log.read_text(errors="replace"))
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def report(self, lines: int = 25) -> str:
        state = "running" if self.alive else f"exited with {self.popen.returncode}"
        return f"--- {self.name} (pid {self.pid}, {state}), last lines of {self.log}:\n{self.tail(lines)}"

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = STOP_S) -> int | None:
        if self.alive:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self._log_file.close()
        return self.popen.returncode


def wait_until(check: Callable[[], T | None], what: str, *, timeout: float, procs: Iterable[Proc] = (),
               interval: float = 0.1) -> T:
    """Poll `check` until it returns something other than None or False; on timeout fail, saying `what` did
    not happen, with the tail of each of `procs`' logs (a process that died ends the wait at once)."""
    procs = list(procs)
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = check()
            if value is not None and value is not False:
                return value
        except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:
            last_error = exc
        dead = [p for p in procs if not p.alive]
        if dead or time.monotonic() > deadline:
            why = f"{dead[0].name} exited" if dead else f"not within {timeout:g} s"
            detail = f" (last error: {last_error!r})" if last_error else ""
            logs = "\n".join(p.report() for p in procs)
            raise AssertionError(f"{what}: {why}{detail}\n{logs}")
        time.sleep(interval)


# ----- the model ---------------------------------------------------------------------------------------------

def write_model_dir(path: Path) -> Path:
    """A tiny model directory `dynamo.mocker` and the frontend accept: a WordLevel tokenizer over `w0`…`w999`
    split on whitespace (word `w{i}` is token i + 3, no BOS added), a Llama-shaped config.json, and a chat
    template that joins the messages' contents (each followed by a space)."""
    path.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate([*SPECIALS, *(f"w{i}" for i in range(VOCAB))])}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(SPECIALS)],
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
        "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 4096,
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    }))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": len(vocab),
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096, "bos_token_id": 1,
        "eos_token_id": 2, "torch_dtype": "bfloat16",
    }))
    return path


def words(ids: Iterable[int]) -> str:
    """The prompt text whose tokens are `[i + 3 for i in ids]`."""
    return " ".join(f"w{i % VOCAB}" for i in ids)


# ----- the load ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoadResult:
    requests: int
    failed: list[str]
    cached_tokens: int
    prompt_tokens: int


def shared_prefix_load(frontend_url: str, *, requests: int = 72, prefixes: int = 4, prefix_blocks: int = 12,
                       suffix_blocks: int = 6, max_tokens: int = 8, concurrency: int = 4, seed: int = 0,
                       model: str = MODEL) -> LoadResult:
    """`requests` completions and chats through the frontend, each a shared prefix (one of `prefixes`, round
    robin) then a suffix of its own: prefixes × prefix blocks + requests × suffix blocks distinct full blocks
    (72 × 6 + 4 × 12 = 480 by default, more than 3 mockers × 128 hold: they evict). Even requests are
    completions, odd ones chats (the chat template adds one space, not a token). `seed` keeps loads apart."""
    prefix_tokens = prefix_blocks * BLOCK_SIZE
    suffix_tokens = suffix_blocks * BLOCK_SIZE
    base = 7919 * seed

    def prompt(n: int) -> str:
        p = n % prefixes
        prefix = words(range(base + p * prefix_tokens, base + (p + 1) * prefix_tokens))
        suffix = words(range(base + 500 + n * 37, base + 500 + n * 37 + suffix_tokens))
        return f"{prefix} {suffix}"

    def one(client: httpx.Client, n: int) -> dict[str, Any]:
        if n % 2 == 0:
            body: dict[str, Any] = {"model": model, "prompt": prompt(n), "max_tokens": max_tokens}
            answer = client.post("/v1/completions", json=body)
        else:
            body = {"model": model, "messages": [{"role": "user", "content": prompt(n)}], "max_tokens": max_tokens}
            answer = client.post("/v1/chat/completions", json=body)
        if answer.status_code != 200:
            return {"error": f"request {n}: HTTP {answer.status_code} {answer.text[:200]}"}
        return answer.json()["usage"]  # type: ignore[no-any-return]

    with httpx.Client(base_url=frontend_url, timeout=60) as client, ThreadPoolExecutor(concurrency) as pool:
        usages = list(pool.map(lambda n: one(client, n), range(requests)))
    failed = [u["error"] for u in usages if "error" in u]
    ok = [u for u in usages if "error" not in u]
    return LoadResult(requests, failed,
                      sum((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in ok),
                      sum(u["prompt_tokens"] for u in ok))


# ----- the fleet ---------------------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SELECTED = re.compile(r"Selected worker .*? worker_id=(\d+) worker_type=(\w+) dp_rank=(\d+) logit=([0-9.]+)")
_PINNED = re.compile(r"Selected pinned worker: worker_type=(\w+), worker_id=(\d+) dp_rank=(\d+), logit: ([0-9.]+)")

@dataclass
class Mocker:
    proc: Proc
    rpc_port: int
    zmq_port: int
    replay_port: int
    worker_id: int = 0
    """Dynamo's instance id of this worker (its `worker_id` on Dynamo's event plane and in its router), which is
    also the id the fleet's indexer and kvctl know its ZMQ stream by. A mocker restarted on its ports
    (`Fleet.restart_mocker`) is a new worker to Dynamo (`dynamo_id`), the same stream to them."""
    dynamo_id: int = 0
    """Dynamo's instance id of the mocker's current process (`worker_id` until it is restarted)."""

    @property
    def zmq_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def kvctl_worker(self) -> str:
        """This mocker as `kvctl serve --worker` takes it."""
        return f"{self.worker_id}={self.zmq_endpoint},replay={self.replay_endpoint}"


@dataclass
class Frontend:
    proc: Proc
    url: str

    def decisions(self) -> list[tuple[int, int, str, float]]:
        """Its KV router's picks, in order, from its log's INFO lines ("Selected worker … worker_id=… worker_type=…
        dp_rank=… logit=…"): (worker id, dp rank, worker type, logit)."""
        text = _ANSI.sub("", self.proc.log.read_text(errors="replace"))
        return [(int(m[1]), int(m[3]), m[2], float(m[4])) for m in _SELECTED.finditer(text)]

    def pinned(self) -> list[tuple[int, int, str, float]]:
        """Its picks of a session's pinned worker, in order ("Selected pinned worker: worker_type=…, worker_id=…
        dp_rank=…, logit: …", INFO, the logit to 3 decimals): (worker id, dp rank, worker type, logit)."""
        text = _ANSI.sub("", self.proc.log.read_text(errors="replace"))
        return [(int(m[2]), int(m[3]), m[1], float(m[4])) for m in _PINNED.finditer(text)]

    def workers(self, fleet: Fleet) -> set[int]:
        """Instances of the fleet's worker endpoint this frontend knows (its /health), the prefill component's
        of a disaggregated fleet included."""
        health = httpx.get(f"{self.url}/health", timeout=5).json()
        return {int(i["instance_id"]) for i in health.get("instances") or []
                if (i.get("namespace"), i.get("endpoint")) == (fleet.namespace, fleet.endpoint)
                and i.get("component") in (fleet.component, "prefill")}


@dataclass
class Router:
    """A `kvctl serve` process; `url` once it has printed it."""

    proc: Proc
    url: str = ""


@dataclass
class Fleet:
    """A running fleet; `start_fleet` makes one. Everything a test needs to reach it is here."""

    workdir: Path
    python: Path
    nats_url: str | None
    namespace: str
    model_dir: Path
    mockers: list[Mocker] = field(default_factory=list)
    frontends: list[Frontend] = field(default_factory=list)
    indexer: Proc | None = None
    indexer_url: str | None = None
    """The reference index: `dynamo.indexer --threads 1` on the mockers' ZMQ streams (`dynamo+http://` in kvctl)."""
    routers: dict[str, Router] = field(default_factory=dict)
    """`kvctl serve` processes by name: `kvctl` follows the mockers' ZMQ streams and replays."""
    component: str = COMPONENT
    endpoint: str = ENDPOINT
    etcd_url: str | None = None
    """Discovery in this etcd (`--discovery-backend etcd`) instead of the file store in `discovery_dir`."""
    _gone: set[int] = field(default_factory=set)
    model: str = MODEL
    block_size: int = BLOCK_SIZE

    @property
    def discovery_dir(self) -> Path:
        """`DYN_FILE_KV` of this fleet (Dynamo's file discovery store)."""
        return self.workdir / "discovery"

    @property
    def frontend(self) -> Frontend:
        return self.frontends[0]

    @property
    def frontend_url(self) -> str:
        """Dynamo's OpenAI HTTP API (and its `/busy_threshold`), with Dynamo's KV router behind it."""
        return self.frontends[0].url

    @property
    def kvctl(self) -> Proc | None:
        router = self.routers.get("kvctl")
        return None if router is None else router.proc

    @property
    def kvctl_url(self) -> str | None:
        """`kvctl serve` following the mockers' ZMQ streams and replays (None in a fleet without it)."""
        router = self.routers.get("kvctl")
        return None if router is None else router.url

    @property
    def worker_ids(self) -> list[int]:
        return [m.worker_id for m in self.mockers]

    @property
    def procs(self) -> list[Proc]:
        started = [*(m.proc for m in self.mockers), self.indexer, *(r.proc for r in self.routers.values()),
                   *(f.proc for f in self.frontends)]
        return [p for p in started if p is not None]

    def env(self, **extra: str) -> dict[str, str]:
        """A Dynamo process's environment: this fleet's discovery and NATS, a home of its own, no hub."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_", "NATS_", "KVCTL_", "HF_"))}
        env.update(DYN_FILE_KV=str(self.discovery_dir), HOME=str(self.workdir / "home"), HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", DYN_TCP_RPC_HOST="127.0.0.1", DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1",
                   DYN_EVENT_PLANE_HOST="127.0.0.1", DYN_SELF_HOST_METADATA="0", PYTHONUNBUFFERED="1", **extra)
        if self.nats_url is not None:
            env["NATS_SERVER"] = self.nats_url
        if self.etcd_url is not None:
            env["ETCD_ENDPOINTS"] = self.etcd_url
        return env

    def planes(self) -> list[str]:
        return ["--discovery-backend", "file" if self.etcd_url is None else "etcd", "--request-plane", "tcp",
                "--event-plane", "nats" if self.nats_url is not None else "zmq"]

    def dump(self, lines: int = 25) -> str:
        return "\n".join(p.report(lines) for p in self.procs)

    # ----- starting ------------------------------------------------------------------------------------------

    def start_mocker(self, mode: str = "agg", *extra: str) -> Mocker:
        """`mode`: `--disaggregation-mode` (agg, prefill or decode); prefill workers serve Dynamo's default
        prefill component, as a disaggregated fleet's do. `extra`: more mocker flags (`--engine-type sglang`)."""
        n, rpc_port, zmq_port, replay_port = len(self.mockers), free_port(), free_port(), free_port()
        component = "prefill" if mode == "prefill" else self.component
        argv = [self.python, "-m", "dynamo.mocker", "--model-path", self.model_dir, "--model-name", self.model,
                "--endpoint", f"dyn://{self.namespace}.{component}.{self.endpoint}",
                "--num-gpu-blocks-override", KV_BLOCKS, "--block-size", self.block_size, "--speedup-ratio", "0",
                "--zmq-kv-events-ports", zmq_port, "--zmq-replay-ports", replay_port, *self.planes(),
                *(["--disaggregation-mode", mode] if mode != "agg" else []), *extra]
        proc = Proc(f"mocker{n}", argv, self.workdir / f"mocker{n}.log", self.env(DYN_TCP_RPC_PORT=str(rpc_port)))
        self.mockers.append(Mocker(proc, rpc_port, zmq_port, replay_port))
        return self.mockers[-1]

    def await_mocker(self, mocker: Mocker) -> None:
        """Until the mocker's instance is in discovery: its worker id is that instance's id."""
        mocker.dynamo_id = wait_until(lambda: self._instance_id(mocker.rpc_port),
                                      f"{mocker.proc.name} registering in discovery", timeout=START_S,
                                      procs=[mocker.proc])
        mocker.worker_id = mocker.worker_id or mocker.dynamo_id

    def restart_mocker(self, mocker: Mocker) -> None:
        """Stop the mocker by its pid and start it again with the same arguments and ports (its event seqs start
        again from 0; Dynamo gives it a new instance id, `dynamo_id`); `await_mocker` it after."""
        mocker.proc.stop()
        name = mocker.proc.name
        restarts = len(list(self.workdir.glob(f"{name}.restart*.log"))) + 1
        mocker.proc = Proc(name, mocker.proc.argv, self.workdir / f"{name}.restart{restarts}.log",
                           self.env(DYN_TCP_RPC_PORT=str(mocker.rpc_port)))
        self._gone.add(mocker.dynamo_id)  # its record, should one linger, is not the new process's
        mocker.dynamo_id = 0

    def instance_records(self) -> list[dict[str, Any]]:
        """The `v1/instances` records of this fleet's discovery store (file or etcd)."""
        if self.etcd_url is not None:
            prefix = base64.b64encode(b"v1/instances/").decode()
            end = base64.b64encode(b"v1/instances0").decode()
            kvs = httpx.post(f"{self.etcd_url}/v3/kv/range", json={"key": prefix, "range_end": end},
                             timeout=5).json().get("kvs") or []
            return [json.loads(base64.b64decode(kv["value"])) for kv in kvs]
        records = []
        for path in (self.discovery_dir / "v1" / "instances").glob("*"):
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue  # being written
        return records

    def _instance_id(self, rpc_port: int) -> int | None:
        for record in self.instance_records():
            transport = str((record.get("transport") or {}).get("tcp", ""))
            if (record.get("namespace"), record.get("endpoint")) == (self.namespace, self.endpoint) \
                    and transport.startswith(f"127.0.0.1:{rpc_port}/") and int(record["instance_id"]) not in self._gone:
                return int(record["instance_id"])
        return None

    def start_frontend(self, name: str = "frontend", *extra: str) -> Frontend:
        """A `dynamo.frontend` with Dynamo's KV router; the first one started is the fleet's `frontend`. `extra`:
        more router flags (`--router-queue-threshold 0.0`)."""
        port = free_port()
        argv = [self.python, "-m", "dynamo.frontend", "--router-mode", "kv", "--router-replica-sync",
                "--http-host", "127.0.0.1", "--http-port", port, "--namespace", self.namespace, *self.planes(),
                *extra]
        frontend = Frontend(Proc(name, argv, self.workdir / f"{name}.log", self.env()), f"http://127.0.0.1:{port}")
        self.frontends.append(frontend)
        return frontend

    def await_frontend(self, frontend: Frontend) -> None:
        """Until the frontend serves the model, with every mocker behind it."""
        wait_until(lambda: self.model in _model_ids(frontend.url),
                   f"{frontend.proc.name} serving model {self.model!r}", timeout=START_S, procs=[frontend.proc])
        wait_until(lambda: frontend.workers(self) >= set(self.worker_ids),
                   f"{frontend.proc.name} seeing workers {self.worker_ids}", timeout=START_S, procs=[frontend.proc])

    def stop_frontend(self, frontend: Frontend) -> None:
        frontend.proc.stop()
        self.frontends.remove(frontend)

    def start_indexer(self, mockers: Sequence[Mocker] | None = None) -> None:
        """The reference index on the ZMQ streams of `mockers` (all of them by default), by their worker ids."""
        port = free_port()
        workers = ",".join(f"{m.worker_id}={m.zmq_endpoint}" for m in (self.mockers if mockers is None else mockers))
        argv = [self.python, "-m", "dynamo.indexer", "--workers", workers, "--block-size", self.block_size,
                "--threads", "1", "--port", port]
        self.indexer = Proc("indexer", argv, self.workdir / "indexer.log", self.env())
        self.indexer_url = f"http://127.0.0.1:{port}"

    def await_indexer(self) -> None:
        assert self.indexer is not None and self.indexer_url is not None
        wait_until(lambda: httpx.get(f"{self.indexer_url}/dump", timeout=5).status_code == 200,
                   "the indexer answering GET /dump", timeout=START_S, procs=[self.indexer])

    def start_router(self, name: str, *args: str | int | Path, block_size: bool = True) -> Router:
        """`kvctl serve` (the project's own, from this venv) with `args` (say `--nats URL`), state in the fleet's
        workdir, log in `{name}.log`; stopped with the fleet. `block_size`: pass the fleet's (else none: with
        `--dynamo-discovery`, the router takes the model cards')."""
        argv = [sys.executable, "-m", "kvctl", "serve", "--listen", "127.0.0.1:0", "--state-dir",
                self.workdir / f"{name}-state", "--reset-states", "--log-level", "info",
                *(["--block-size", self.block_size] if block_size else []), *args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
        router = Router(Proc(name, argv, self.workdir / f"{name}.log", {**env, "PYTHONUNBUFFERED": "1"},
                             pipe_stdout=True))
        self.routers[name] = router
        return router

    def await_router(self, router: Router) -> None:
        """Until it has printed its URL (its first stdout line) and answers /healthz."""
        line = router.proc.first_line(START_S)
        if not line.startswith("http://127.0.0.1:") or line.endswith(":0"):
            raise AssertionError(f"{router.proc.name} printed {line!r}, not its URL\n{router.proc.report()}")
        router.url = line
        wait_until(lambda: httpx.get(f"{line}/healthz", timeout=5).status_code == 200,
                   f"{router.proc.name} answering /healthz", timeout=START_S, procs=[router.proc])

    def restart_router(self, name: str) -> Router:
        """Start the router again on the same state dir, so that it restores its snapshot (same arguments, less
        `--reset-states`), stopping it first by its pid (SIGTERM: it writes its snapshot) if it still runs;
        `await_router` (or `await_kvctl`) it after."""
        old = self.routers[name]
        old.proc.stop()
        argv = [a for a in old.proc.argv if a != "--reset-states"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
        restarts = len(list(self.workdir.glob(f"{name}.restart*.log"))) + 1
        router = Router(Proc(name, argv, self.workdir / f"{name}.restart{restarts}.log",
                             {**env, "PYTHONUNBUFFERED": "1"}, pipe_stdout=True))
        self.routers[name] = router
        return router

    def start_kvctl(self) -> Router:
        """The router `kvctl`: following every mocker's ZMQ stream and replay, by the mocker's worker id."""
        return self.start_router("kvctl", *(a for m in self.mockers for a in ("--worker", m.kvctl_worker())))

    def await_kvctl(self) -> None:
        """`await_router`, then until it reports a stream for every mocker."""
        router = self.routers["kvctl"]
        self.await_router(router)
        wanted = {f"{w}:0" for w in self.worker_ids}
        wait_until(lambda: {f"{s['worker']['worker_id']}:{s['worker']['dp_rank']}"
                            for s in httpx.get(f"{router.url}/v1/status", timeout=5).json().get("streams") or []}
                   >= wanted, f"kvctl serve reporting streams for {sorted(wanted)}", timeout=START_S,
                   procs=[router.proc])

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def _model_ids(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=5).json()["data"]}


JOIN_S = 1.0
"""ZMQ's slow joiner: time for the indexer's and kvctl's SUB sockets to be joined before anything is published."""


def start_fleet(workdir: Path, python: Path, *, mockers: int = 3, nats_url: str | None = None,
                namespace: str = NAMESPACE, indexer: bool = True, kvctl: bool = True,
                routers: Mapping[str, Sequence[str]] | None = None, etcd_url: str | None = None,
                modes: Sequence[str] = (), block_size: int = BLOCK_SIZE, mocker_args: Sequence[str] = (),
                frontend_args: Sequence[str] = ()) -> Fleet:
    """Start a fleet and wait until every part of it is ready; on failure stop what started, then raise.

    `routers`: more `kvctl serve` processes, by name, with their arguments (the mockers' worker ids and endpoints
    are not known yet: say `{"nats": ["--nats", nats_url]}`), started with the fleet so that, like the indexer
    and the `kvctl` router, they are there before any request is made (Dynamo's event planes keep no history).
    `fleet.await_router` has waited for their URL; what else makes one ready is for its user to wait for.
    `etcd_url`: Dynamo's discovery in that etcd (`--discovery-backend etcd`, `ETCD_ENDPOINTS`), not files.
    `modes`: each mocker's `--disaggregation-mode`, in place of `mockers` aggregated ones; `mocker_args` and
    `frontend_args`: more flags for every mocker and for the frontend."""
    workdir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(workdir=workdir, python=python, nats_url=nats_url, namespace=namespace,
                  model_dir=write_model_dir(workdir / "model"), etcd_url=etcd_url, block_size=block_size)
    (workdir / "home").mkdir(exist_ok=True)
    try:
        for mode in modes or ["agg"] * mockers:
            fleet.start_mocker(mode, *mocker_args)
        for mocker in fleet.mockers:
            fleet.await_mocker(mocker)
        frontend = fleet.start_frontend("frontend", *frontend_args)
        if indexer:
            fleet.start_indexer()
        if kvctl:
            fleet.start_kvctl()
        for name, args in (routers or {}).items():
            fleet.start_router(name, *args)
        if indexer:
            fleet.await_indexer()
        if kvctl:
            fleet.await_kvctl()
        for name in routers or {}:
            fleet.await_router(fleet.routers[name])
        fleet.await_frontend(frontend)
        time.sleep(JOIN_S)
    except BaseException:
        fleet.stop()
        raise
    return fleet


# ----- reading the indexes -----------------------------------------------------------------------------------

def indexer_blocks(fleet: Fleet) -> dict[int, int]:
    """Blocks per worker in the reference index (its /dump: stored events, one block each, per worker)."""
    dump = httpx.get(f"{fleet.indexer_url}/dump", timeout=10).json()
    counts: dict[int, int] = {}
    for group in dump.values():
        for event in group["events"]:
            stored = event["event"]["data"].get("stored") if isinstance(event["event"]["data"], dict) else None
            if stored:
                counts[event["worker_id"]] = counts.get(event["worker_id"], 0) + len(stored["blocks"])
    return counts


def kvctl_blocks(url: str, model: str = "default") -> dict[int, int]:
    """Blocks per worker in a kvctl router (its /v1/tree/stats)."""
    stats = httpx.get(f"{url}/v1/tree/stats", params={"model": model}, timeout=10).json()
    workers = stats["models"][model]["workers"]
    counts: dict[int, int] = {}
    for key, blocks in workers.items():
        worker = int(key.split(":")[0])
        counts[worker] = counts.get(worker, 0) + blocks
    return counts


def settled(read: Callable[[], T], what: str, *, quiet_s: float = 1.0, timeout: float = 30.0,
            procs: Iterable[Proc] = ()) -> T:
    """`read()` once it has given the same answer for `quiet_s` (nothing more arriving)."""
    last: list[Any] = [object(), time.monotonic()]

    def check() -> T | None:
        value = read()
        if value != last[0]:
            last[:] = [value, time.monotonic()]
            return None
        return value if time.monotonic() - last[1] >= quiet_s else None

    return wait_until(check, f"{what} settling", timeout=timeout, procs=procs, interval=0.2)


def replica_sync_both_ways(fleet: Fleet, url: str, plane: Callable[[str], dict[str, Any]], model: str) -> None:
    """Replica sync between the router at `url` and the fleet's frontend (`--router-replica-sync`), either way:
    each request the frontend routes is added, prefilled and freed on the router; a request the router books
    shows in the frontend's own per-worker load, and goes when freed. `plane`: the router's event-plane status;
    `model`: the model its workers are in there (a plane with model cards: theirs)."""
    peers_before = plane(url)["counts"].get("peer_sequence_events", 0)
    assert shared_prefix_load(fleet.frontend_url, requests=8, seed=4).failed == []
    wait_until(lambda: plane(url)["counts"].get("peer_sequence_events", 0) >= peers_before + 3 * 8,
               "the frontend's request lifecycles on the router", timeout=15, procs=fleet.procs)
    wait_until(lambda: all(w["active_requests"] == 0 for w in httpx.get(f"{url}/v1/workers").json()["workers"]),
               "every request the frontend freed freed on the router too", timeout=15, procs=fleet.procs)
    counts = plane(url)["counts"]  # each of the frontend's bookings taken in as its own, none refused
    assert counts.get("peer_booked", 0) >= 8 and counts.get("peer_freed", 0) >= 8, counts
    refused = [x for x in httpx.get(f"{url}/v1/status", timeout=10).json()["health"]["losses"]
               if x["surface"] == "replica_sync"]
    assert refused == [], refused

    tokens = list(range(5000, 5000 + 20 * 16))
    decision = httpx.post(f"{url}/v1/route", json={"model": model, "token_ids": tokens, "reserve": True,
                                                   "request_id": "kvctl-1"}, timeout=10).json()
    worker = str(decision["worker_id"])
    wait_until(lambda: frontend_load(fleet, worker).get("prefill_tokens", 0) >= len(tokens) or None,
               "the frontend counting the router's booked prefill", timeout=15, procs=fleet.procs)
    assert frontend_load(fleet, worker)["decode_blocks"] >= 20
    assert httpx.delete(f"{url}/v1/requests/kvctl-1", params={"model": model}, timeout=10).status_code == 200
    wait_until(lambda: frontend_load(fleet, worker) == {"prefill_tokens": 0, "decode_blocks": 0},
               "the frontend dropping the router's freed request", timeout=15, procs=fleet.procs)


_LOAD = re.compile(r'^dynamo_frontend_worker_active_(prefill_tokens|decode_blocks)\{[^}]*worker_id="(\d+)"[^}]*\} '
                   r"(\S+)$", re.M)


def frontend_load(fleet: Fleet, worker: str) -> dict[str, float]:
    """The frontend's own view of a worker's in-flight load (its /metrics gauges)."""
    text = httpx.get(f"{fleet.frontend_url}/metrics", timeout=10).text
    return {kind: float(value) for kind, wid, value in _LOAD.findall(text) if wid == worker}
