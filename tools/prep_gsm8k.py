#!/usr/bin/env python
"""GSM8K rows a user has into megarl's prompt JSONL (docs/data.md, "Preparing datasets").

    python tools/prep_gsm8k.py IN OUT [--chat] [--system TEXT]

IN: GSM8K's own files (JSONL or parquet rows {"question", "answer"}, the answer's worked
solution ending in "#### 72"). OUT: one {"prompt": question + instruction, "answer": "72"} per
line (--chat: {"messages": [...]} instead), for reward.fn=math or exact. Nothing is downloaded.
A row without "####" is skipped and counted.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from megarl.data import prep  # noqa: E402
from megarl.data.prep import record  # noqa: E402


def final_answer(solution: str) -> str | None:
    """The number after GSM8K's '####' (thousands separators dropped), or None."""
    if "####" not in solution:
        return None
    return solution.rsplit("####", 1)[1].strip().replace(",", "") or None


def convert(rows: list[dict], chat: bool = False, system: str = "") -> tuple[list[dict], int]:
    out, skipped = [], 0
    for i, row in enumerate(rows):
        answer = final_answer(str(row.get("answer", "")))
        if not row.get("question") or answer is None:
            skipped += 1
            continue
        out.append(record(row["question"], answer, chat, system, index=i))
    return out, skipped


def main(argv=None) -> int:
    return prep.main(__doc__, convert, "no question or no '####' answer", argv)


if __name__ == "__main__":
    sys.exit(main())
