#!/usr/bin/env python
"""MATH-style rows a user has into megarl's prompt JSONL (docs/data.md, "Preparing datasets").

    python tools/prep_math.py IN OUT [--chat] [--system TEXT]

IN: a folder of MATH's per-problem .json files (train/algebra/1.json ...), or JSONL / JSON /
parquet rows with "problem" and either "answer" (MATH-500) or a "solution" whose last \\boxed{}
holds it. OUT: one {"prompt": problem + instruction, "answer": ..., "level", "type"} per line
(--chat: {"messages": [...]}), for reward.fn=math. Nothing is downloaded. A row without a
problem or an answer is skipped and counted.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from megarl.data import prep  # noqa: E402
from megarl.data.prep import record  # noqa: E402
from megarl.rewards.answer import last_boxed  # noqa: E402

KEPT = ("level", "type", "subject", "unique_id")   # fields copied when a row has them


def convert(rows: list[dict], chat: bool = False, system: str = "") -> tuple[list[dict], int]:
    out, skipped = [], 0
    for row in rows:
        answer = row.get("answer") or last_boxed(str(row.get("solution", "")))
        if not row.get("problem") or answer in (None, ""):
            skipped += 1
            continue
        out.append(record(row["problem"], str(answer), chat, system, **{k: row[k] for k in KEPT if k in row}))
    return out, skipped


def main(argv=None) -> int:
    return prep.main(__doc__, convert, 'no problem or no answer', argv)


if __name__ == "__main__":
    sys.exit(main())
