"""What an offline W&B run wrote, read back from its .wandb file: the records of W&B's own
protobuf schema (wandb.proto), framed as a LevelDB-style log (a 7-byte file header, then 32 KiB
blocks of records, each with a 7-byte header: checksum, length, type full/first/middle/last)."""
from __future__ import annotations

import json
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """Every Record in the .wandb file `path`, in order."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, out, parts = HEADER, [], b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if left < HEADER or (length == 0 and kind == 0):    # the block's zero-filled tail
            pos += left
            continue
        parts += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(parts)
            out.append(rec)
            parts = b""
    return out


def history(path: Path) -> list[dict]:
    """The rows logged (`run.log`), keys as logged, values decoded from their JSON."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records(path) if r.WhichOneof("record_type") == "history"]


def config(path: Path) -> dict:
    """The run's config as its config records set it (later records update earlier ones)."""
    out = {}
    for r in records(path):
        if r.WhichOneof("record_type") == "config":
            out.update({item.key: json.loads(item.value_json) for item in r.config.update})
        elif r.WhichOneof("record_type") == "run":
            out.update({item.key: json.loads(item.value_json) for item in r.run.config.update})
    return out


def run_files(run_dir: Path) -> list[Path]:
    """The .wandb files of the W&B runs written under <run_dir>/wandb, oldest first."""
    return sorted((Path(run_dir) / "wandb").glob("*run-*/run-*.wandb"), key=lambda p: p.parent.name)
