"""The pure-Python fallback end to end: `KVCTL_PURE_PYTHON=1` makes a real `kvctl` process (a command, and a
router) run the twin of the C extension, says so, and answers exactly as the C path does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvctl import __version__
from tests.commands.live_router import PROMPT, loaded_router
from tests.conftest import implementation
from tests.core.test_hashing import VECTORS
from tests.support.served import on_both_route_paths

PATHS = {"C": "C", "Python": "none, pure Python"}  # implementation: what --version and /v1/status call it


def _take(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kvctl processes started from here on run `path` (the C one skips where this install has none)."""
    implementation(path)
    if path == "Python":
        monkeypatch.setenv("KVCTL_PURE_PYTHON", "1")
    else:
        monkeypatch.delenv("KVCTL_PURE_PYTHON", raising=False)


def _kvctl(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "kvctl", *args], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("path", PATHS)
def test_version_names_the_speedups_in_use(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _take(path, monkeypatch)
    assert _kvctl("--version") == f"kvctl {__version__} (native speedups: {PATHS[path]})\n"


def _hashes(path: str, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, str]:
    _take(path, monkeypatch)
    case = max(VECTORS["cases"], key=lambda c: c["num_tokens"])
    plain = json.loads(_kvctl("hash", "-o", "json", "-b", str(case["block_size"]), "--", *map(str, case["tokens"])))
    assert plain["sequence_hashes"] == case["sequence_hashes_u64"]
    return plain, _kvctl("-o", "name", "hash", "-b", "4", "--lora-name", "adapter", "1", "2", "3", "4")


def test_hash_answers_the_same_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _hashes("Python", monkeypatch) == _hashes("C", monkeypatch)


def _routes(path: str, state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, object]]:
    """What a router on `path`, loaded with the dump fixture, answers to a few routes, good and bad."""
    _take(path, monkeypatch)
    with loaded_router(state_dir) as client:
        assert client.get("/v1/status").json()["native_speedups"] == PATHS[path]
        answers = []
        for body in (json.dumps({"token_ids": PROMPT * 64, "explain": True}).encode(),
                     json.dumps({"explain": True, "token_ids": PROMPT[:40]}).encode(),
                     b'{"token_ids": [1, 4294967296]}', b'{"token_ids": [1, 2.5], "model": "m"}', b"[1]"):
            reply = client.post("/v1/route", content=body)
            answer = reply.json()
            if reply.status_code == 200:  # which of the equally good workers wins is chosen at random
                answer = sorted(answer["candidates"], key=lambda c: (c["worker_id"], c["dp_rank"]))
            answers.append((reply.status_code, answer))
        return answers


@on_both_route_paths
def test_a_router_routes_the_same_on_both_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    routes = {path: _routes(path, tmp_path / path, monkeypatch) for path in PATHS}
    assert routes["Python"] == routes["C"]
    assert [status for status, _ in routes["Python"]] == [200, 200, 422, 422, 422]
