"""tools/prep_gsm8k.py and tools/prep_math.py: files a user has (tiny fixtures written here, in
each layout the tools read) into the documented JSONL, which loads as data.prompts and scores
with reward.fn=math's gold answers. No download, no model."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

from megarl.data.prompts import load_prompts

GSM8K = [{"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
          "answer": "In May she sold 48/2 = <<48/2=24>>24.\n48+24 = <<48+24=72>>72\n#### 72"},
         {"question": "A big sum?", "answer": "It is 1,000 + 234.\n#### 1,234"},
         {"question": "No final line", "answer": "forgot the marker"}]
MATH = [{"problem": "Simplify $\\frac{2}{4}$.", "level": "Level 1", "type": "Prealgebra",
         "solution": "Divide: $\\boxed{\\frac{1}{2}}$."},
        {"problem": "What is $1+1$?", "answer": "2", "solution": "Two."},
        {"problem": "No answer here", "solution": "none boxed"}]


def run_tool(name, *args):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / name), *map(str, args)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_gsm8k_jsonl_and_parquet_into_prompt_rows(tmp_path):
    src = tmp_path / "gsm8k_train.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    assert "2 rows written, 1 skipped" in run_tool("prep_gsm8k.py", src, tmp_path / "out.jsonl")
    rows = load_prompts(str(tmp_path / "out.jsonl"), answer_key="answer")
    assert [r["answer"] for r in rows] == ["72", "1234"]
    assert rows[0]["prompt"].startswith("Natalia sold 48") and "\\boxed{}" in rows[0]["prompt"]
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(GSM8K), tmp_path / "train.parquet")
    run_tool("prep_gsm8k.py", tmp_path / "train.parquet", tmp_path / "chat.jsonl", "--chat", "--system", "Be brief.")
    chat = load_prompts(str(tmp_path / "chat.jsonl"), answer_key="answer")
    assert [m["role"] for m in chat[0]["messages"]] == ["system", "user"] and chat[1]["answer"] == "1234"


def test_math_folder_and_rows_into_prompt_rows(tmp_path):
    folder = tmp_path / "MATH" / "train" / "prealgebra"
    folder.mkdir(parents=True)
    for i, row in enumerate(MATH):
        (folder / f"{i}.json").write_text(json.dumps(row))
    assert "2 rows written, 1 skipped" in run_tool("prep_math.py", tmp_path / "MATH", tmp_path / "out.jsonl")
    rows = load_prompts(str(tmp_path / "out.jsonl"), answer_key="answer")
    assert [r["answer"] for r in rows] == ["\\frac{1}{2}", "2"]
    assert rows[0]["level"] == "Level 1" and rows[0]["type"] == "Prealgebra"
    from megarl.rewards.math import math_score  # the gold answers parse as mathematics
    assert math_score("so \\boxed{0.5}", rows[0], finished=True) == 1.0
    src = tmp_path / "math500.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in MATH))
    run_tool("prep_math.py", src, tmp_path / "chat.jsonl", "--chat")
    assert len(load_prompts(str(tmp_path / "chat.jsonl"))) == 2
