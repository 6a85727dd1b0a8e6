"""`megarl train` on real-format prompt data: the shipped math sample as parquet, text and chat
rows, scored by reward.fn=math (math-verify in its worker process). The tiny countdown model
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


def test_math_verifier_trains_on_parquet_text_and_chat_rows(chat_model, remote_engine, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    rows = [json.loads(line) for line in (ROOT / "tests/data/math_sample.jsonl").read_text().splitlines()]
    data = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_struct_array(pa.array(rows)), data)   # every row's columns

    run_dir = tmp_path / "run"
    proc = run_py(["-m", "megarl.cli", "train", "recipes/tiny_cpu.yaml", f"model.path={chat_model}",
                   f"data.prompts={data}", f"run.dir={run_dir}", "reward.fn=math", "train.steps=2",
                   "train.groups_per_step=8", "rollout.dump_every=1", *remote_engine.overrides],
                  env=remote_engine.env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        assert m["reward_errors"] == 0 and m["reward_timeouts"] == 0, m
        assert 0.0 <= m["reward_mean"] <= 1.0
    # both kinds of rows reached the engine: chat rows rendered by the template end in "="
    dumped = [json.loads(line) for line in (run_dir / "samples" / "step_0.jsonl").read_text().splitlines()]
    ends = {s["prompt"].rstrip().endswith("=") for s in dumped}
    assert ends == {True, False}, [s["prompt"] for s in dumped[:8]]
