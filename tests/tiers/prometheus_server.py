"""A real Prometheus server (Debian's `prometheus`) for the tests: loopback, free port, storage in a temp dir.

It scrapes the given targets every second, and evaluates the `rule_files` given every second; `wait_for_scrapes`
blocks until each target has been scraped often enough for `increase()` over a short window to have data.
Stopped by its pid at the end.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import eventually

BINARY = shutil.which("prometheus")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def prometheus(targets: list[str] | Mapping[str, list[str]], workdir: Path, *,
               rule_files: Sequence[Path] = ()) -> Iterator[str]:
    """Yields the server's URL; skips the test where the binary is not installed. `targets` is a list (job
    `tiers`) or the targets of each job."""
    if BINARY is None:
        pytest.skip("prometheus is not installed (Debian package `prometheus`; .ci/run installs it)")
    jobs = {"tiers": targets} if isinstance(targets, list) else targets
    config = workdir / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
                      f"rule_files: [{', '.join(repr(str(f)) for f in rule_files)}]\n"
                      "scrape_configs:\n" + "".join(
                          f"  - job_name: {job}\n    static_configs:\n"
                          f"      - targets: [{', '.join(repr(t) for t in job_targets)}]\n"
                          for job, job_targets in jobs.items()))
    port = free_port()
    log = (workdir / "prometheus.log").open("w")
    process = subprocess.Popen(
        [BINARY, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def wait_for_scrapes(url: str, targets: int, scrapes: int, timeout: float = 20.0, job: str = "tiers") -> None:
    """Until each of `targets` (of the jobs `job` matches) has `scrapes` successful scrapes in the last `scrapes`
    seconds."""
    query = f"count(count_over_time(up{{job=~'{job}'}}[{scrapes}s]) >= {scrapes} and up == 1)"
    with httpx.Client(base_url=url, timeout=2.0) as http:
        def result() -> list[Any]:
            try:
                response = http.get("/api/v1/query", params={"query": query})
            except httpx.TransportError:  # Prometheus still starting
                return []
            return response.json()["data"]["result"] if response.is_success else []  # type: ignore[no-any-return]

        eventually(result, f"Prometheus at {url} to scrape {targets} targets {scrapes} times",
                   until=lambda r: bool(r) and int(float(r[0]["value"][1])) >= targets, timeout=timeout,
                   interval=0.25)
