"""`megarl train` on real-format prompt data: the shipped math sample as a veRL parquet (chat
rows) mixed 3:1 with a JSONL of text rows, scored by reward.fn=math (math-verify in its worker
process) against each file's ground truth. The tiny countdown model
scores ~0 on math: this checks the pipeline (load, chat template, encode, verify, count), not
that reward rises. About a minute on CPU."""
import json
import shutil

import pytest
from conftest import ROOT, run_py

# the tiny model's tokenizer has no chat template (tools/make_tiny_model.py builds none): the test
# gives its copy of the model a minimal one; "=" ends the generation prompt as in countdown prompts
TEMPLATE = ("{% for m in messages %}<bos> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}={% endif %}")


@pytest.fixture
def chat_model(tiny_model, tmp_path):
    model = tmp_path / "tiny_chat"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}, indent=2))
    return model


def _verl_row(row: dict, i: int, chat: bool) -> dict:
    """Math sample row `i` as veRL writes it: the gold answer in reward_model.ground_truth, the
    prompt as chat messages (`chat`) or as its text; extra_info on every other row only (null in
    the parquet's column elsewhere)."""
    messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
    text = " ".join(m["content"] for m in messages if m["role"] == "user")
    return {"data_source": "math_sample", "prompt": messages if chat else text, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": row["answer"]},
            **({"extra_info": {"index": i}} if i % 2 else {})}


def test_math_verifier_trains_on_a_verl_parquet_and_a_jsonl_mixed_3_to_1(chat_model, remote_engine, tmp_path):
    """A veRL parquet (chat-message prompts, reward_model.ground_truth) and a JSONL of text
    prompts as a 3:1 mixture, scored by reward.fn=math against each file's ground truth. Three
    prompts too long for the engines' context (two in the parquet, one in the JSONL) are dropped
    and counted, the files left as they were; each step's groups come from the sources the
    mixture's seeded draws name."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from megarl.data.mixture import MixtureSampler
    rows = [json.loads(line) for line in (ROOT / "tests/data/math_sample.jsonl").read_text().splitlines()]
    long_text = " ".join(["word"] * 400)   # 400 tokens: more than max_model_len 256 - max_new_tokens 56
    long_row = {"prompt": long_text, "answer": "1"}
    parquet, jsonl = tmp_path / "verl.parquet", tmp_path / "more.jsonl"
    chat_rows = [_verl_row(r, i, chat=True) for i, r in enumerate([*rows, long_row, long_row])]
    pq.write_table(pa.Table.from_pylist(chat_rows), parquet)
    jsonl.write_text("".join(json.dumps(_verl_row(r, i, chat=False)) + "\n" for i, r in enumerate([long_row, *rows])))
    before = {p: p.read_bytes() for p in (parquet, jsonl)}

    run_dir, steps, groups = tmp_path / "run", 2, 8
    proc = run_py(["-m", "megarl.cli", "train", "recipes/tiny_cpu.yaml", f"model.path={chat_model}",
                   f"data.prompts={{{parquet}: 3, {jsonl}: 1}}", "data.answer_key=reward_model.ground_truth",
                   f"run.dir={run_dir}", "reward.fn=math", f"train.steps={steps}", f"train.groups_per_step={groups}",
                   "rollout.mode=sync", "rollout.dump_every=1", *remote_engine.overrides],
                  env=remote_engine.env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert {p: p.read_bytes() for p in (parquet, jsonl)} == before   # dropped, not edited away
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(steps))
    for m in metrics:
        assert m["data_prompts_dropped"] == 3, m
        assert m["reward_errors"] == 0 and m["reward_timeouts"] == 0, m
        assert 0.0 <= m["reward_mean"] <= 1.0
    assert "3 of 43 prompts dropped" in proc.stdout + proc.stderr
    # chat rows rendered by the template end in "=": the parquet's; the JSONL's are texts
    mixture = MixtureSampler([len(rows)] * 2, [3, 1], seed=0)   # the run's draws (run.seed=0)
    for step in range(steps):
        dumped = [json.loads(line) for line in (run_dir / "samples" / f"step_{step}.jsonl").read_text().splitlines()]
        assert all("word word" not in s["prompt"] for s in dumped)
        from_parquet = {s["group"] for s in dumped if s["prompt"].rstrip().endswith("=")}
        from_jsonl = {s["group"] for s in dumped} - from_parquet
        picks = [mixture.pick(n) for n in range(step * groups, (step + 1) * groups)]
        assert (len(from_parquet), len(from_jsonl)) == (picks.count(0), picks.count(1)), step
    picks = [mixture.pick(n) for n in range(4000)]
    assert 0.72 < picks.count(0) / len(picks) < 0.78   # the 3:1 the weights ask for
