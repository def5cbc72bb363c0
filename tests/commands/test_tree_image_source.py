"""A kvctl state dir's image as a `kvctl tree` and `events publish` source: its body is binary since v3, so
no dump reader takes it; read as a restore reads it, it holds the events it was written from."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from kvctl.core.events.dump_file import read_router_events
from kvctl.server.persistence import snapshot
from kvctl.server.state import Fleet
from tests.commands.test_tree import DUMP, DUMP_FILE, kvctl
from tests.server.test_serve_process import serving


def _image(state_dir: Path, *models: str) -> Path:
    fleet = Fleet(block_size=16)
    for model in models:
        fleet.apply(model, read_router_events(DUMP), 0.0)
    return snapshot.write(snapshot.capture(fleet, time.time()), state_dir)


def test_an_image_holds_what_it_was_written_from(tmp_path: Path) -> None:
    image = _image(tmp_path, "default")
    code, out, err = kvctl("tree", "diff", str(image), str(DUMP_FILE), "-o", "json", "--exit-code")
    assert code == 0 and json.loads(out)["equal"] is True, err
    stats = [json.loads(kvctl("tree", "stats", source, "-o", "json")[1]) for source in (str(image), str(DUMP_FILE))]
    assert stats[0] == stats[1]
    code, out, err = kvctl("events", "publish", str(image), "--nats", "nats://127.0.0.1:1", "--dry-run", "-o", "json")
    assert code == 0 and json.loads(out)["events"] > 0, err


def test_model_picks_one_of_an_images_models(tmp_path: Path) -> None:
    image = _image(tmp_path, "default", "llama")
    code, out, _ = kvctl("tree", "diff", str(image), str(DUMP_FILE), "--model", "llama", "--exit-code")
    assert code == 0
    code, _, err = kvctl("tree", "dump", str(image), "--model", "nope")
    assert code == 1 and "no model 'nope' in this image (it holds default, llama)" in err


def test_a_damaged_image_is_an_error_naming_it(tmp_path: Path) -> None:
    image = _image(tmp_path, "default")
    data = bytearray(image.read_bytes())
    data[(data.index(b"\n") + len(data)) // 2] ^= 0x01
    image.write_bytes(bytes(data))
    code, _, err = kvctl("tree", "dump", str(image))
    assert code == 1 and "checksum mismatch" in err and str(image) in err


def test_a_state_dir_is_read_offline_as_a_restart_restores_it(tmp_path: Path) -> None:
    """A small router writes no image (issue 37): its state dir is the state log alone, read whole, and a log
    segment named on its own is an error naming the dir to give instead."""
    state_dir = tmp_path / "state"
    with serving(state_dir) as (proc, client):
        answer = client.post("/v1/events", content=DUMP, headers={"content-type": "application/x-ndjson"}).json()
        assert answer["rejected"] == {}
        proc.send_signal(signal.SIGTERM)  # the log's tail fsynced, no image written
        assert proc.wait(30) == 0
    assert not (state_dir / snapshot.FILENAME).exists()
    stats = [json.loads(kvctl("tree", "stats", source, "-o", "json")[1]) for source in (str(state_dir),
                                                                                        str(DUMP_FILE))]
    assert stats[0] == stats[1]
    code, out, err = kvctl("tree", "diff", str(state_dir), str(DUMP_FILE), "-o", "json", "--exit-code")
    assert code == 0 and json.loads(out)["equal"] is True, err
    code, _, err = kvctl("tree", "stats", str(state_dir / "state.log.00000000"))
    assert code == 1 and "binary, not a dump file" in err and f"give its state dir ({state_dir})" in err
    code, _, err = kvctl("tree", "stats", str(tmp_path))
    assert code == 2 and "not a kvctl state dir" in err
