"""Every user-facing input that is wrong gets one clear line, exit code 2, no traceback, and
nothing written: the table (docs/bad_inputs.md lists it for users).

Each case: (id, what the user gives, text the message must contain). All cases run in one
process (bad_input_runner.py); every case's run.dir is checked not to exist afterwards.
"""
import json

import pytest

from conftest import run_py

# (id, overrides or full argv (starting with "-"), message must contain)
CASES = [
    ("unknown_key", ["train.stepz=3"], "train.stepz"),
    ("wrong_type", ["train.steps=many"], "train.steps"),
    ("steps_zero", ["train.steps=0"], "train.steps"),
    ("algo_unknown", ["algo.name=dpo"], "algo.name"),
    ("dtype_unknown", ["model.dtype=float8"], "model.dtype"),
    ("tp_zero", ["parallel.tp=0"], "parallel.tp"),
    ("tp_vs_world", ["parallel.tp=2"], "parallel.tp"),
    ("temperature_zero", ["rollout.temperature=0"], "rollout.temperature"),
    ("top_p_nucleus", ["rollout.top_p=0.9"], "rollout.top_p"),
    ("n_zero", ["rollout.n=0"], "rollout.n"),
    ("mode_unknown", ["rollout.mode=fast"], "rollout.mode"),
    ("concurrency_zero", ["rollout.concurrency=0"], "rollout.concurrency"),
    ("staleness_negative", ["rollout.max_staleness=-1"], "rollout.max_staleness"),
    ("async_without_staleness", ["rollout.async=true", "rollout.max_staleness=0"], "rollout.max_staleness"),
    ("engine_mode_unknown", ["rollout.engine_mode=cloud"], "rollout.engine_mode"),
    ("remote_without_urls", ["rollout.engine_mode=remote"], "rollout.engine_urls"),
    ("remote_bad_url", ["rollout.engine_mode=remote", "rollout.engine_urls=[ftp://host:1]"], "rollout.engine_urls"),
    ("failures_max_negative", ["rollout.engine_failures_max=-1"], "rollout.engine_failures_max"),
    ("nonfinite_policy", ["train.on_nonfinite=ignore"], "train.on_nonfinite"),
    ("kl_kind", ["algo.kl_kind=k9"], "algo.kl_kind"),
    ("loss_agg", ["algo.loss_agg=sum"], "algo.loss_agg"),
    ("gamma_range", ["algo.gamma=1.5"], "algo.gamma"),
    ("keep_zero", ["checkpoint.keep=0"], "checkpoint.keep"),
    ("bucket_zero", ["weight_sync.bucket_mb=0"], "weight_sync.bucket_mb"),
    ("micro_batch_divides", ["train.micro_batch_size=7"], "train.micro_batch_size"),
    ("override_not_key_value", ["train.steps"], "override"),
    ("recipe_missing", ["-", "train", "recipes/none.yaml"], "recipes/none.yaml"),
    ("reward_fn_unknown", ["reward.fn=nonexistent"], "reward.fn"),
    ("data_missing", ["data.prompts={tmp}/nope.jsonl"], "data.prompts"),
    ("data_bad_json_row", ["data.prompts={tmp}/bad_row.jsonl"], "row 2"),
    ("data_missing_field", ["data.prompts={tmp}/no_field.jsonl"], "data.prompt_key"),
    ("data_empty_prompt", ["data.prompts={tmp}/empty_prompt.jsonl"], "data.prompt_key"),
    ("data_empty_file", ["data.prompts={tmp}/empty.jsonl"], "data.prompts"),
    ("data_no_answer", ["reward.fn=math", "data.prompts={tmp}/no_answer.jsonl"], "data.answer_key"),
    ("chat_without_template", ["data.prompts={tmp}/chat.jsonl"], "data.messages_key"),
    ("reward_timeout_zero", ["reward.timeout_s=0"], "reward.timeout_s"),
    ("model_missing", ["model.path={tmp}/no_model"], "model.path"),
    ("model_not_hf", ["model.path={tmp}/not_a_model"], "model.path"),
    ("reward_model_missing", ["reward.model_path={tmp}/no_rm"], "reward.model_path"),
    ("run_dir_under_a_file", ["run.dir={tmp}/a_file/run"], "run.dir"),
    ("staging_missing", ["weight_sync.staging_dir={tmp}/no_staging"], "weight_sync.staging_dir"),
    ("simulate_bad_gpu", ["-", "simulate", "recipes/tiny_cpu.yaml", "--gpu", "a100"], "--gpu"),
]


@pytest.fixture(scope="module")
def results(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_inputs")
    (tmp / "bad_row.jsonl").write_text('{"prompt": "<bos> n1 ="}\n{"prompt": \n')
    (tmp / "no_field.jsonl").write_text('{"question": "1+1"}\n')
    (tmp / "empty_prompt.jsonl").write_text('{"prompt": ""}\n')
    (tmp / "empty.jsonl").write_text("\n")
    (tmp / "no_answer.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?"}\n')
    (tmp / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "n1"}]}\n')
    (tmp / "not_a_model").mkdir()
    (tmp / "not_a_model" / "config.json").write_text("{}")
    (tmp / "a_file").write_text("not a folder")
    cases = []
    for cid, args, _ in CASES:
        run_dir = tmp / "runs" / cid
        if args[0] == "-":
            argv = args[1:]
        else:
            argv = ["train", "recipes/tiny_cpu.yaml", f"model.path={tiny_model}",
                    f"data.prompts={tiny_model}/prompts.jsonl", f"run.dir={run_dir}",
                    *[a.format(tmp=tmp) for a in args]]
        cases.append({"id": cid, "argv": argv})
    (tmp / "cases.json").write_text(json.dumps(cases))
    proc = run_py(["tests/e2e/bad_input_runner.py", str(tmp / "cases.json"), str(tmp / "out.json")], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp, json.loads((tmp / "out.json").read_text())


@pytest.mark.parametrize("cid,args,named", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_one_clear_line(results, cid, args, named):
    tmp, out = results
    r = out[cid]
    assert "Traceback" not in r["stderr"], r["stderr"][-3000:]
    assert r["rc"] == 2, r
    lines = [line for line in r["stderr"].splitlines() if line.strip()]
    assert any(named in line for line in lines), r["stderr"]
    assert not (tmp / "runs" / cid).exists(), "a failed start wrote into its run dir"


def test_debug_shows_the_traceback(tmp_path):
    proc = run_py(["-m", "megarl.cli", "train", "recipes/tiny_cpu.yaml", "train.stepz=3"],
                  env={"MEGARL_DEBUG": "1"}, timeout=120)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "train.stepz" in proc.stderr


def test_the_table_is_big_enough():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)
