"""Issue 43 point 5: does every engine event variant decode within 1.2x of its engine's plain store?

The point says the typed decode pass (`_decode_common`) takes every vLLM 0.34 and SGLang 0.5.23 field and
signed hashes, so no variant falls to the general walk (`_decode_any`), about 3x slower. This measures it on
the engines' own bytes: each BlockStored-carrying payload of `tests/fixtures/engine-streams/` (one per
variant, named from the line's contents and its stream's title; sentinels and removal-only lines left out),
timed through `decode_engine_batch(payload, default_block_size=16)`, with whether the typed pass took it.

The judged figure is each variant against its plain twin: the variant's payload with every store's fields
set as its engine's plain store has them (the 20-block store of the first worker of its base stream: vLLM's
`v1_single_group`, whose group_idx 0 and full_attention kind every 0.34 GPU store carries; SGLang's s1 w0 GPU
store), keeping its stores, block hashes, token ids and block sizes, with EAGLE pairs flattened to the tokens
Dynamo hashes. The twin does the same work without the fields that make the variant, so the ratio is what
those fields cost; a batch of five 4-block stores is not one 20-block store, and a payload has a fixed cost.
Beside it, for a sense of scale: the ratio per payload against the plain store, and per block against the
line through the same worker's plain 1-block sentinel and its plain 20-block store, read at the variant's
block count. The older single-message captures (`tests/fixtures/vllm-0.33/`, `sglang-0.5.23/`, 4 blocks)
are reference rows, a check on that line; so is the plain SGLang store re-encoded with each signed hash as
its u64 (byte for byte the capture otherwise), which shows what the typed pass would make of it: every
SGLang 0.5.23 store carries signed hashes, its plain one included.

Each figure is the median (`--stat min`: the least) over `--repeat` rounds; a round times every payload once,
for at least `--min-time` seconds (calls per measurement calibrated first), so drift of a shared machine falls
on all rows alike. The clock is the process's CPU time (decoding is one thread's CPU work), so time the
process spent waiting for a core another process held does not count; `--clock wall` times wall time. The
max/min column is each row's spread over the rounds: where it is well over 1.1, other work still disturbed it
(caches, a shared core's frequency) and the ratios are that unsure. `kept` is the events the decode returned
over those on the wire: an event it drops (as Dynamo drops it) is cheaper, not faster.

    python benchmarks/decode_variants_bench.py [--repeat 9] [--min-time 0.2] [--stat median|min]
        [--clock process|wall] [--json PATH] [--check]

Prints a table and the variants over 1.2x. Exit 0, or with `--check` exit 1 when a variant is over 1.2x
its plain twin or an engine's plain store is itself off the typed pass (then its ratios say nothing about the
walk). A gate to run by hand; the test suite does not run it.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvctl.core import native  # noqa: E402
from kvctl.core.events import engine  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
STREAMS = {"vllm": FIXTURES / "engine-streams" / "vllm-0.34", "sglang": FIXTURES / "engine-streams" / "sglang-0.5.23"}
CAPTURES = {"vllm": FIXTURES / "vllm-0.33", "sglang": FIXTURES / "sglang-0.5.23"}
BASE_STREAM = {"vllm": "v1_single_group", "sglang": "s1_default_dp_tiers_session_lora"}
DP_FIELD = {"vllm": "dp_rank", "sglang": "attn_dp_rank"}
BLOCK_SIZE = 16
LIMIT = 1.2
CLOCKS: dict[str, Callable[[], float]] = {"process": time.process_time, "wall": time.perf_counter}
# Fields every plain store may carry (at their plain values, see `_features`); any other field set is a feature.
PLAIN_FIELDS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "lora_id",
                "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}
NAMED_FIELDS = ("locality", "ownership", "session_id", "cache_salt")  # shown with their value


@dataclass
class Case:
    engine: str
    variant: str
    source: str  # file:line (worker)
    role: str  # "plain" (the judged baseline), "plain 1-block" (the line's other point), "variant", "reference"
    blocks: int
    signed: int  # block and parent hashes < 0 on the wire
    payload: bytes = field(repr=False)
    typed: bool = False
    kept: str = ""  # events decode_engine_batch returned / events on the wire (a dropped one costs less)
    number: int = 1
    times_us: list[float] = field(default_factory=list)
    us: float = 0.0
    ratio_payload: float = 0.0
    ratio_block: float = 0.0
    twin: Case | None = field(default=None, repr=False)  # the judged baseline of a variant
    ratio_twin: float = 0.0


def _stores(batch: list[Any]) -> list[dict[str, Any]]:
    return [e for e in batch[1] if isinstance(e, dict) and e.get("type") == "BlockStored"]


def _signed(batch: list[Any]) -> int:
    return sum(1 for e in batch[1] if isinstance(e, dict)
               for h in [*e.get("block_hashes", []), e.get("parent_block_hash")] if isinstance(h, int) and h < 0)


def _group(event: dict[str, Any]) -> str:
    text = f"G{event.get('group_idx') or 0} {event.get('kv_cache_spec_kind') or 'full_attention'}"
    if event.get("kv_cache_spec_sliding_window") is not None:
        text += f" {event['kv_cache_spec_sliding_window']}"
    if event.get("block_size") not in (None, BLOCK_SIZE):
        text += f" (block_size {event['block_size']})"
    return text


def _features(engine_name: str, batch: list[Any], title: str) -> list[str]:
    """What sets a payload's stores apart from a plain store; [] for a plain one."""
    stores = _stores(batch)
    features: list[str] = []
    groups = {e.get("group_idx") or 0: _group(e) for e in stores}
    if len(groups) > 1 or any(g != "G0 full_attention" for g in groups.values()):
        features.append(" + ".join(groups.values()))
    for medium in dict.fromkeys(e.get("medium") for e in stores if e.get("medium") not in (None, "GPU")):
        on_tier = [e for e in stores if e.get("medium") == medium]
        sizes = {len(e["block_hashes"]) for e in on_tier}
        features.append(f"tier {medium}" + (f" ({len(on_tier)} stores x {sizes.pop()} blocks)"
                                            if len(on_tier) > 1 and len(sizes) == 1 else ""))
    for name in NAMED_FIELDS:
        for value in dict.fromkeys(e.get(name) for e in stores if e.get(name) is not None):
            text = f"{name} {value}"
            if name == "cache_salt" and (fmt := re.search(r"format='(\w+)'", title)):
                text += f", format {fmt.group(1)}"
            features.append(text)
    for lora in dict.fromkeys((e.get("lora_name"), e.get("lora_id")) for e in stores if e.get("lora_name")):
        features.append(f"LoRA {lora[0]}" + ("" if lora[1] is None else f" (lora_id {lora[1]})"))
    if any(e.get("extra_keys") and any(e["extra_keys"]) and not e.get("lora_name") for e in stores):
        features.append("extra_keys")  # multimodal or cache_salt keys (LoRA's are its name, shown above)
    if any(e.get("token_ids") and isinstance(e["token_ids"][0], list) for e in stores):
        features.append("EAGLE pairs (token_ids [t, t+1])")
    others = {k for e in stores for k, v in e.items() if v is not None} - PLAIN_FIELDS - set(NAMED_FIELDS)
    features.extend(sorted(others))  # lookahead_token_ids, and any field a later capture adds
    if len(batch) > 2 and batch[2]:
        features.append(f"{DP_FIELD[engine_name]} {batch[2]}")
    return features


def _case(engine_name: str, variant: str, source: str, role: str, payload: bytes) -> Case:
    batch = msgspec.msgpack.decode(payload)
    blocks = sum(len(e["block_hashes"]) for e in _stores(batch))
    return Case(engine_name, variant, source, role, blocks, _signed(batch), payload)


def _u64_twin(payload: bytes) -> bytes | None:
    """The payload with each negative hash as its u64, or None where re-encoding does not give back the payload
    itself (then the twin would differ in more than the hashes)."""
    batch = msgspec.msgpack.decode(payload)
    if msgspec.msgpack.encode(batch) != payload:
        return None
    for event in batch[1]:
        if isinstance(event, dict):
            event["block_hashes"] = [h % 2**64 for h in event.get("block_hashes", [])]
            if isinstance(event.get("parent_block_hash"), int):
                event["parent_block_hash"] %= 2**64
    return msgspec.msgpack.encode(batch)


KEPT_BY_TWIN = ("type", "block_hashes", "parent_block_hash", "token_ids", "block_size")
"""What a variant's plain twin keeps of each of its stores: the work (blocks, tokens, and a block size that cuts)."""


def plain_twin(variant: Case, plain: Case) -> Case:
    """The variant's payload with each store's other fields set as the plain store has them (and EAGLE pairs
    flattened to the tokens Dynamo hashes, the batch's DP rank the plain one's): the same stores, blocks and
    token ids without the fields that make the variant, so the ratio is what those fields cost."""
    base = msgspec.msgpack.decode(plain.payload)
    plain_store = _stores(base)[0]
    batch = msgspec.msgpack.decode(variant.payload)
    for i, event in enumerate(batch[1]):
        if not (isinstance(event, dict) and event.get("type") == "BlockStored"):
            continue
        twin = {key: event[key] if key in KEPT_BY_TWIN else value for key, value in plain_store.items()}
        tokens = twin["token_ids"]
        if tokens and isinstance(tokens[0], list):
            twin["token_ids"] = [pair[0] for pair in tokens] + [tokens[-1][1]]
        batch[1][i] = twin
    batch[2:] = base[2:]
    return _case(variant.engine, f"plain twin of: {variant.variant}", variant.source, "plain twin",
                 msgspec.msgpack.encode(batch))


def collect(engine_name: str) -> list[Case]:
    """The engine's plain stores (judged baseline and 1-block point), its variants and the reference rows."""
    folder = STREAMS[engine_name]
    titles: dict[str, str] = json.loads((folder / "manifest.json").read_text())["streams"]
    plain: Case | None = None
    point: Case | None = None
    variants: dict[str, Case] = {}
    for path in sorted(folder.glob("*.jsonl")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            message = json.loads(line)
            payload = bytes.fromhex(message["payload_hex"])
            batch = msgspec.msgpack.decode(payload)
            if not _stores(batch):
                continue
            source = f"{path.stem.split('_')[0]}:{number} w{message['worker']}"
            features = _features(engine_name, batch, titles.get(path.stem, ""))
            if path.stem == BASE_STREAM[engine_name] and not features and message["worker"] == 0:
                what = "sentinel" if message["what"].startswith("sentinel") else "store"
                if what == "store" and plain is None:
                    plain = _case(engine_name, "plain store", source, "plain", payload)
                elif what == "sentinel" and point is None:
                    point = _case(engine_name, "plain 1-block store (sentinel)", source, "plain 1-block", payload)
            elif features and not message["what"].startswith("sentinel"):
                name = " + ".join(features) + (" [synthetic]" if "SYNTHETIC" in path.stem else "")
                if name not in variants:
                    variants[name] = _case(engine_name, name, source, "variant", payload)
    if plain is None or point is None:
        raise SystemExit(f"{engine_name}: no plain store or plain 1-block sentinel in {BASE_STREAM[engine_name]}")
    references = []
    captures = json.loads((CAPTURES[engine_name] / "manifest.json").read_text())
    version = captures["producer"]["version"]
    for message in captures["messages"]:
        payload = (CAPTURES[engine_name] / message["file"]).read_bytes()
        batch = msgspec.msgpack.decode(payload)
        events = [e for e in batch[1] if isinstance(e, dict)]
        if len(events) == 1 and _stores(batch) and not _features(engine_name, batch, "") \
                and events[0].get("parent_block_hash") is None:
            source = f"{CAPTURES[engine_name].name}/{message['file']}"
            references.append(_case(engine_name, f"plain store, {version} capture", source, "reference", payload))
    if plain.signed and (twin := _u64_twin(plain.payload)) is not None:
        references.append(_case(engine_name, "plain store, signed hashes as u64 (re-encoded)", plain.source,
                                "reference", twin))
    twins = []
    for variant in variants.values():
        variant.twin = plain_twin(variant, plain)
        twins.append(variant.twin)
    return [plain, point, *variants.values(), *references, *twins]


def measure(cases: list[Case], repeat: int, min_time: float, stat: str, clock: Callable[[], float]) -> None:
    """Calibrate calls per measurement, then time every case once per round."""
    timers: dict[int, timeit.Timer] = {}
    for case in cases:
        case.typed = engine._decode_common(case.payload, BLOCK_SIZE) is not None
        decoded = engine.decode_engine_batch(case.payload, default_block_size=BLOCK_SIZE)
        case.kept = f"{len(decoded.events)}/{len(msgspec.msgpack.decode(case.payload)[1])}"
        timer = timeit.Timer(partial(engine.decode_engine_batch, case.payload, default_block_size=BLOCK_SIZE),
                             timer=clock)
        timers[id(case)] = timer
        number = 1
        while (elapsed := timer.timeit(number)) < min_time / 10:
            number *= 10
        case.number = max(1, math.ceil(number * min_time * 1.05 / elapsed))
    for _ in range(repeat):
        for case in cases:
            case.times_us.append(timers[id(case)].timeit(case.number) / case.number * 1e6)
    for case in cases:
        case.us = min(case.times_us) if stat == "min" else statistics.median(case.times_us)


def judge(cases: list[Case]) -> None:
    """Per-payload ratio against the plain store; per-block ratio against the plain line at the same block count."""
    plain = next(c for c in cases if c.role == "plain")
    point = next(c for c in cases if c.role == "plain 1-block")
    slope = (plain.us - point.us) / (plain.blocks - point.blocks)
    for case in cases:
        case.ratio_payload = case.us / plain.us
        case.ratio_block = case.us / (point.us + slope * (case.blocks - point.blocks))
        case.ratio_twin = case.us / case.twin.us if case.twin else 0.0


def table(cases: list[Case]) -> str:
    head = ("engine", "variant", "source", "role", "blocks", "signed", "us/payload", "us/block", "max/min",
            "x payload", "x block", "x twin", "typed", "kept")
    rows = [head] + [(c.engine, c.variant, c.source, c.role, str(c.blocks), str(c.signed), f"{c.us:.2f}",
                      f"{c.us / c.blocks:.3f}", f"{max(c.times_us) / min(c.times_us):.2f}", f"{c.ratio_payload:.2f}",
                      f"{c.ratio_block:.2f}", f"{c.ratio_twin:.2f}" if c.twin else "", "yes" if c.typed else "no",
                      c.kept) for c in cases]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    right = set(range(4, 12))
    return "\n".join("  ".join(v.rjust(widths[i]) if i in right else v.ljust(widths[i]) for i, v in enumerate(r))
                     for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9, help="rounds; each figure is their --stat")
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per measurement, at least")
    parser.add_argument("--stat", choices=("median", "min"), default="median", help="of the rounds")
    parser.add_argument("--clock", choices=CLOCKS, default="process", help="CPU time of this process, or wall time")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results there as JSON")
    parser.add_argument("--check", action="store_true",
                        help=f"exit 1 when a variant is over {LIMIT}x its plain twin or a plain store is off "
                             "the typed pass")
    args = parser.parse_args()
    cases: list[Case] = []
    for engine_name in STREAMS:
        engine_cases = collect(engine_name)
        measure(engine_cases, args.repeat, args.min_time, args.stat, CLOCKS[args.clock])
        judge(engine_cases)
        cases += engine_cases
    print(f"decode_engine_batch(payload, default_block_size={BLOCK_SIZE}); native: {native.IMPLEMENTATION}; "
          f"{args.stat} of {args.repeat} rounds of >= {args.min_time} s {args.clock} time; "
          f"python {platform.python_version()}")
    print(table(cases))
    over = [c for c in cases if c.role == "variant" and c.ratio_twin > LIMIT]
    untyped_plain = [c for c in cases if c.role == "plain" and not c.typed]
    print(f"over {LIMIT}x its plain twin: " + ("; ".join(f"{c.engine} {c.variant} ({c.ratio_twin:.2f}x, typed "
                                                    f"{'yes' if c.typed else 'no'})" for c in over) or "none"))
    for c in untyped_plain:
        print(f"{c.engine}: the plain store itself is off the typed pass ({c.signed} signed hashes), so its "
              "ratios compare the walk with the walk")
    if args.json:
        rows = [{k: v for k, v in asdict(c).items() if k not in ("payload", "twin")} for c in cases]
        args.json.write_text(json.dumps({
            "call": f"decode_engine_batch(payload, default_block_size={BLOCK_SIZE})", "native": native.NATIVE,
            "python": platform.python_version(), "repeat": args.repeat, "min_time_s": args.min_time, "stat": args.stat,
            "clock": args.clock, "limit": LIMIT,
            "rows": rows, "over": [c.engine + ": " + c.variant for c in over],
            "plain_off_typed_pass": [c.engine for c in untyped_plain]}, indent=1) + "\n")
    if args.check and (over or untyped_plain):
        sys.exit(1)


if __name__ == "__main__":
    main()
