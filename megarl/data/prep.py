"""Turning math datasets a user has into megarl's prompt format (docs/data.md, "Preparing
datasets"): rows read from JSONL, a JSON array, parquet or a folder of per-problem JSON files
(MATH's layout); rows written as JSONL `{"prompt": ..., "answer": ...}` (or `{"messages": ...}`
with `chat`). No downloads: tools/prep_gsm8k.py and tools/prep_math.py are the command lines.
"""
from __future__ import annotations

import json
from pathlib import Path

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
