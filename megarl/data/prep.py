"""Turning math datasets a user has into megarl's prompt format (docs/data.md, "Preparing
datasets"): rows read from JSONL, a JSON array, parquet or a folder of per-problem JSON files
(MATH's layout); rows written as JSONL `{"prompt": ..., "answer": ...}` (or `{"messages": ...}`
with `chat`). No downloads: tools/prep_gsm8k.py and tools/prep_math.py are the command lines.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

#: appended to each question: the verifiers read the last \boxed{} (megarl/rewards/answer.py)
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def read_rows(path: str) -> list[dict]:
    """The rows of `path`: a .parquet file, a .json file (an array, or one object), a folder of
    .json files (walked recursively, sorted) or JSONL (any other suffix)."""
    p = Path(path)
    if not p.exists():
        raise SystemExit(f"{path}: no such file or folder")
    if p.is_dir():
        return [row for f in sorted(p.rglob("*.json")) for row in read_rows(str(f))]
    if p.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq
        return pq.read_table(p).to_pylist()
    if p.suffix.lower() == ".json":
        data = json.loads(p.read_text(encoding="utf-8"))
        return data if isinstance(data, list) else [data]
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


def record(question: str, answer: str, chat: bool, system: str = "", **extra) -> dict:
    """One row of megarl's format: the question with the instruction, as a text prompt or as
    chat messages (`system` first when given), the gold answer, and `extra` fields kept."""
    text = f"{question.strip()}\n{INSTRUCTION}"
    if not chat:
        return {"prompt": text, "answer": answer, **extra}
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return {"messages": messages, "answer": answer, **extra}


def write_rows(rows: list[dict], out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(doc: str, convert: Callable[[list[dict], bool, str], tuple[list[dict], int]], skipped_why: str,
         argv=None) -> int:
    """A prep tool's command line (`IN OUT [--chat] [--system TEXT]`): `convert` the rows of IN
    (JSONL or parquet) and write OUT, saying how many rows were skipped and why (`skipped_why`)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--chat", action="store_true", help="write chat messages instead of a prompt text")
    ap.add_argument("--system", default="", help="with --chat: a system message first")
    args = ap.parse_args(argv)
    rows, skipped = convert(read_rows(args.input), args.chat, args.system)
    write_rows(rows, args.output)
    print(f"{args.output}: {len(rows)} rows written, {skipped} skipped ({skipped_why})")
    return 0
