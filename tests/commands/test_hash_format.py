"""Block hashes survive every JSON tool (issue 37): `--hash-format str|hex` writes them as strings, which jq before 1.7
(Debian 12's 1.6 included) does not round, `route --local-hashes` reads every format, and the pipeline `kvctl route
--help` documents routes as the hashes themselves would."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvctl.commands import route
from kvctl.commands._hashes import HashFormat, shown_hashes
from kvctl.commands._input import parse_hash_text
from tests.commands.live_router import PROMPT, PROMPT_HASHES, json_of, kvctl, loaded_router, url_of

BIG = 2**64 - 3  # past 2^53: a double cannot hold it


def test_every_hash_field_is_written_in_the_format_asked_and_read_back() -> None:
    data = {"block_size": 16, "local_hashes": [BIG, 5], "events": [{"parent_hash": BIG, "block_hashes": [7]}]}
    assert shown_hashes(data, HashFormat.dec) is data
    as_str = shown_hashes(data, HashFormat.str)
    assert as_str == {"block_size": 16, "local_hashes": [str(BIG), "5"],
                      "events": [{"parent_hash": str(BIG), "block_hashes": ["7"]}]}
    assert shown_hashes(data, HashFormat.hex)["local_hashes"] == [f"{BIG:#x}", "0x5"]
    for written in (json.dumps(as_str["local_hashes"]), f"{BIG:#x} 0x5", f"{BIG}, 5"):
        assert parse_hash_text(written, "test") == [BIG, 5]


def test_hash_answers_in_each_format(tmp_path: Path) -> None:
    for fmt, first in (("dec", PROMPT_HASHES[0]), ("str", str(PROMPT_HASHES[0])), ("hex", f"{PROMPT_HASHES[0]:#x}")):
        answer = json_of(kvctl("http://unused", "hash", *map(str, PROMPT), "-o", "json", "--hash-format", fmt))
        assert answer["local_hashes"][0] == first


@pytest.mark.skipif(shutil.which("jq") is None, reason="needs jq (.ci/run installs Debian's)")
def test_the_documented_pipeline_routes_exactly_through_this_machines_jq(tmp_path: Path) -> None:
    pipeline = next(line.strip() for line in route.EXAMPLES.splitlines() if "| jq" in line)
    (tmp_path / "ids.json").write_text(json.dumps(PROMPT))
    bin_dir = str(Path(sys.executable).parent)
    assert shutil.which("kvctl", path=bin_dir), "the pipeline runs the installed kvctl"
    with loaded_router(tmp_path / "state") as client:
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "KVCTL_SERVER": url_of(client)}
        done = subprocess.run(["bash", "-o", "pipefail", "-c", pipeline + " -o json"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        decision = json.loads(done.stdout)
        assert decision["overlap_blocks"] == decision["required_blocks"] == len(PROMPT_HASHES)
        assert re.match(r"jq-1\.\d", subprocess.run(["jq", "--version"], capture_output=True, text=True).stdout)


