"""A count and its noun agree in number everywhere kvctl writes one: no `1 blocks`, no `worker(s)`.

The source scan finds the ways it was broken (a count formatted before a plural noun, or `(s)`); each is
written with `kvctl.core.words.counted`. A count against a whole (`2 of 4 workers`) keeps the plural.
"""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from kvctl.cli import app
from kvctl.core.words import counted

SOURCE = Path(__file__).resolve().parent.parent / "kvctl"
NOUNS = ("blocks|workers|events|engines|requests|models|batches|gaps|entries|lines|nodes|routes|errors|replicas|"
         "times|findings|connections|messages|publishers|streams|tokens|subjects|records|files|changes|rows|"
         "channels|endpoints|engine streams|engine endpoints")
COUNT = r"(?:\{[^{}:!]+\}|%d)"
BROKEN = re.compile(rf"(?<!of ){COUNT} (?:(?:{NOUNS})\b|\w+(?: \w+)?\(s\))")
WHOLE = re.compile(rf"\bof {COUNT} (?:{NOUNS})\b")  # `{n} of {m} workers`: the noun counts the whole
NOT_COUNTS = ("{url} workers", "{fmt.name} events")  # a command line (`kvctl --server URL workers`), a format's name


def test_no_count_is_written_before_a_noun_that_cannot_agree() -> None:
    found = [f"{path.relative_to(SOURCE.parent)}:{n}: {line.strip()}"
             for path in sorted(SOURCE.rglob("*.py")) for n, line in enumerate(path.read_text().splitlines(), 1)
             if BROKEN.search(WHOLE.sub("", line)) and not any(text in line for text in NOT_COUNTS)]
    assert found == [], "\n".join(found)


def test_counted_agrees() -> None:
    assert [counted(n, "block") for n in (0, 1, 2)] == ["0 blocks", "1 block", "2 blocks"]
    assert counted(1, "batch", "batches") == "1 batch" and counted(3, "batch", "batches") == "3 batches"


def test_one_block_of_one_worker_reads_singular(tmp_path: Path) -> None:
    dump = tmp_path / "one.jsonl"
    dump.write_text('{"worker_id": 1, "event": {"event_id": 1, "data": {"stored": {"parent_hash": null, '
                    '"blocks": [{"block_hash": 42, "tokens_hash": 4242}]}}, "dp_rank": 0}}\n')
    result = CliRunner().invoke(app, ["tree", "dump", str(dump)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == f"{dump}: 1 block held by 1 worker"
