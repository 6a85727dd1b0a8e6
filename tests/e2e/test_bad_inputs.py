"""Every user-facing input that is wrong gets one clear line, exit code 2, no traceback, and
nothing written: the table (docs/bad_inputs.md lists it for users).

Each case: (id, what the user gives, text the message must contain). All cases run in one
process (bad_input_runner.py); every case's run.dir is checked not to exist afterwards.
"""
import json
import os
import shutil

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
    ("temperature_zero", ["rollout.sampling.temperature=0"], "rollout.sampling.temperature"),
    ("top_p_range", ["rollout.sampling.top_p=1.5"], "rollout.sampling.top_p"),
    ("top_k_zero", ["rollout.sampling.top_k=0"], "rollout.sampling.top_k"),
    ("n_zero", ["rollout.sampling.n=0"], "rollout.sampling.n"),
    ("mode_unknown", ["rollout.mode=fast"], "rollout.mode"),
    ("concurrency_zero", ["rollout.partial.concurrency=0"], "rollout.partial.concurrency"),
    ("staleness_negative", ["rollout.partial.max_staleness=-1"], "rollout.partial.max_staleness"),
    ("async_without_staleness", ["rollout.partial.async=true", "rollout.partial.max_staleness=0"],
     "rollout.partial.max_staleness"),
    ("engine_mode_unknown", ["rollout.engines.mode=cloud"], "rollout.engines.mode"),
    ("remote_without_urls", ["rollout.engines.mode=remote"], "rollout.engines.urls"),
    ("remote_bad_url", ["rollout.engines.mode=remote", "rollout.engines.urls=[ftp://host:1]"], "rollout.engines.urls"),
    ("failures_max_negative", ["rollout.engines.failures_max=-1"], "rollout.engines.failures_max"),
    ("nonfinite_policy", ["train.on_nonfinite=ignore"], "train.on_nonfinite"),
    ("kl_kind", ["algo.kl_kind=k9"], "algo.kl_kind"),
    ("loss_agg", ["algo.loss_agg=sum"], "algo.loss_agg"),
    ("gamma_range", ["algo.gamma=1.5"], "algo.gamma"),
    ("keep_zero", ["checkpoint.keep=0"], "checkpoint.keep"),
    ("bucket_zero", ["weight_sync.bucket_mb=0"], "weight_sync.bucket_mb"),
    ("weight_addr_not_here", ["weight_sync.master_addr=192.0.2.1"], "weight_sync.master_addr"),
    ("weight_backend_ipc_on_cpu", ["weight_sync.backend=ipc"], "weight_sync.backend='ipc' needs GPUs"),
    ("weight_backend_ipc_remote", ["rollout.engines.mode=remote", "rollout.engines.urls=[http://127.0.0.1:9]",
                                   "weight_sync.backend=ipc"], "rollout.engines.mode=remote"),
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
    ("checkpoint_dir_under_a_file", ["checkpoint.dir={tmp}/a_file/ckpts"], "checkpoint.dir"),
    ("staging_missing", ["weight_sync.transport=files", "weight_sync.staging_dir={tmp}/no_staging"],
     "weight_sync.staging_dir"),
    ("simulate_bad_gpu", ["-", "simulate", "recipes/tiny_cpu.yaml", "--gpu", "a100"], "--gpu"),
    # config parsing: the file, the line, the override
    ("recipe_not_yaml", ["-", "train", "{tmp}/not_yaml.yaml"], "not_yaml.yaml' is not valid YAML"),
    ("recipe_a_list", ["-", "train", "{tmp}/a_list.yaml"], "a_list.yaml' holds a list"),
    ("recipe_a_folder", ["-", "train", "recipes"], "recipe 'recipes' is a folder"),
    ("section_given_a_value", ["train=3"], "train is a section of settings"),
    ("override_not_yaml", ["train.steps=[1"], "override 'train.steps=[1'"),
    ("list_given_one_value", ["rollout.engines.mode=remote", "rollout.engines.urls=http://h:1"],
     "rollout.engines.urls is a list"),
    # contradictory settings: refused, not silently ignored
    ("urls_while_inprocess", ["rollout.engines.urls=[http://127.0.0.1:9]"], "rollout.engines.mode=remote"),
    ("api_key_while_inprocess", ["rollout.engines.api_key=k"], "rollout.engines.api_key"),
    ("critic_warmup_without_critic", ["algo.name=grpo", "train.critic_warmup_steps=2"], "train.critic_warmup_steps"),
    ("model_coef_without_model", ["reward.model_coef=0.5"], "reward.model_coef"),
    # model files
    ("model_truncated_weights", ["model.path={tmp}/m_truncated"], "model.safetensors is damaged"),
    ("model_without_tokenizer", ["model.path={tmp}/m_no_tokenizer"], "has no tokenizer files"),
    ("model_config_not_json", ["model.path={tmp}/m_bad_config"], "config.json does not load"),
    ("model_tokenizer_broken", ["model.path={tmp}/m_bad_tokenizer"], "its tokenizer does not load"),
    # hardware limits (this machine: one NUMA node, no GPU) and the model's
    ("engine_tp_beyond_machine", ["rollout.engines.tp=4"], "rollout.engines.tp=4"),
    ("engine_tp_not_dividing_heads", ["rollout.engines.tp=3"], "attention heads"),
    ("context_beyond_model", ["rollout.engines.max_model_len=512"], "max_position_embeddings=256"),
    # data vs the engine's limits: found before the run, the row named
    # (data.overlong_prompts=error: the default drops and counts such a prompt, unless every one is)
    ("prompt_beyond_context", ["data.prompts={tmp}/long_prompt.jsonl", "data.overlong_prompts=error"],
     "row 3: a prompt of 232 tokens"),
    ("every_prompt_beyond_context", ["data.prompts={tmp}/all_long.jsonl"], "row 1: a prompt of 232 tokens"),
    ("budget_beyond_context", ["rollout.sampling.max_new_tokens=254"], "rollout.sampling.max_new_tokens=254 exceeds"),
    ("budget_is_the_context", ["rollout.sampling.max_new_tokens=256"], "must be below rollout.engines.max_model_len"),
    ("data_not_text", ["data.prompts={tmp}/binary.jsonl"], "not a text file"),
    ("url_with_api_path", ["rollout.engines.mode=remote", "rollout.engines.urls=[http://node1:8000/v1]"],
     "without /v1"),
    ("data_is_a_folder", ["data.prompts={tmp}"], "is a folder"),
    ("data_one_json_array", ["data.prompts={tmp}/array.jsonl"], "one JSON object per line"),
    ("nccl_without_gpu", ["parallel.backend=nccl"], "parallel.backend='nccl' needs GPUs"),
    ("kv_cache_beyond_memory", ["rollout.engines.kv_cache_mb=100000000"], "rollout.engines.kv_cache_mb=100000000"),
    ("model_index_names_missing_file", ["model.path={tmp}/m_index"], "names missing files"),
    ("model_config_disagrees_with_weights", ["model.path={tmp}/m_layers"], "missing HF parameters"),
    ("model_architecture_unsupported", ["model.path={tmp}/m_arch"], "unsupported architecture"),
    ("megatron_path_shard_missing", ["model.megatron_path={tmp}/megatron_ckpt"], "__0_0.distcp is missing"),
    # checkpoints: every one damaged (one damaged among intact ones resumes: tests/dist/test_damaged_checkpoint.py)
    ("checkpoints_all_damaged", ["checkpoint.dir={tmp}/damaged_ckpts"], "every checkpoint is damaged"),
]

# Found only when the engines are reached, after the models are built: the run dir then holds
# its lock and config.yaml, but nothing of a run (no checkpoint, no metrics). {port}: a local
# port where nothing listens.
LATE = [
    ("remote_url_nothing_listens", ["rollout.engines.mode=remote", "rollout.engines.urls=[http://127.0.0.1:{port}]",
                                    "rollout.engines.start_timeout_s=15"], "http://127.0.0.1:{port}"),
]


def _closed_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _damaged_dist_checkpoint(folder):
    """A torch_dist folder (as tools/convert_hf_to_megatron.py writes) whose shard file is gone."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # no process group: saved as one rank
        dcp.save({"w": torch.zeros(4)}, checkpoint_id=str(folder))
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (folder / "__0_0.distcp").unlink()


@pytest.fixture(scope="module")
def results(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_inputs")
    port = _closed_port()
    (tmp / "bad_row.jsonl").write_text('{"prompt": "<bos> n1 ="}\n{"prompt": \n')
    (tmp / "no_field.jsonl").write_text('{"question": "1+1"}\n')
    (tmp / "empty_prompt.jsonl").write_text('{"prompt": ""}\n')
    (tmp / "empty.jsonl").write_text("\n")
    (tmp / "no_answer.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?"}\n')
    (tmp / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "n1"}]}\n')
    (tmp / "not_a_model").mkdir()
    (tmp / "not_a_model" / "config.json").write_text("{}")
    (tmp / "a_file").write_text("not a folder")
    (tmp / "not_yaml.yaml").write_text("run: [\n  dir: x\n")
    (tmp / "a_list.yaml").write_text("- train\n- steps\n")
    (tmp / "long_prompt.jsonl").write_text('{"prompt": "<bos> n3 ="}\n\n{"prompt": "<bos> %s ="}\n'
                                           % " ".join(["n3"] * 230))
    (tmp / "all_long.jsonl").write_text('{"prompt": "<bos> %s ="}\n' % " ".join(["n3"] * 230))
    (tmp / "binary.jsonl").write_bytes(b"\xff\xfe\x00binary\n")
    (tmp / "array.jsonl").write_text('[\n  {"prompt": "<bos> n3 ="}\n]\n')
    _damaged_dist_checkpoint(tmp / "megatron_ckpt")
    (tmp / "damaged_ckpts" / "step_3").mkdir(parents=True)
    (tmp / "damaged_ckpts" / "step_3" / "COMPLETE").write_text("3")
    for name, damage in [("m_truncated", "truncate"), ("m_no_tokenizer", "no_tokenizer"),
                         ("m_bad_config", "config"), ("m_bad_tokenizer", "tokenizer"), ("m_index", "index"),
                         ("m_layers", "layers"), ("m_arch", "arch")]:
        folder = tmp / name
        shutil.copytree(tiny_model, folder, ignore=shutil.ignore_patterns("prompts.jsonl", "eval.jsonl"))
        if damage == "truncate":
            with open(folder / "model.safetensors", "r+b") as f:
                f.truncate(100_000)
        elif damage == "no_tokenizer":
            for f in ("tokenizer.json", "tokenizer_config.json", "tokenization_countdown.py"):
                (folder / f).unlink()
        elif damage == "index":   # a sharded checkpoint's index naming a shard that is not there
            (folder / "model.safetensors.index.json").write_text(json.dumps(
                {"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}))
        elif damage in ("layers", "arch"):   # config.json of another model than the weights
            config = json.loads((folder / "config.json").read_text())
            if damage == "layers":
                config.update(num_hidden_layers=3, layer_types=["full_attention"] * 3)
            else:
                config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
            (folder / "config.json").write_text(json.dumps(config))
        elif damage == "config":
            (folder / "config.json").write_text('{"model_type": "qwen2",')
        else:
            (folder / "tokenizer.json").write_text("{")
    cases = []
    for cid, args, _ in CASES + LATE:
        run_dir = tmp / "runs" / cid
        if args[0] == "-":
            argv = [a.format(tmp=tmp) for a in args[1:]]
        else:
            argv = ["train", "recipes/tiny_cpu.yaml", f"model.path={tiny_model}",
                    f"data.prompts={tiny_model}/prompts.jsonl", f"run.dir={run_dir}",
                    *[a.format(tmp=tmp, port=port) for a in args]]
        cases.append({"id": cid, "argv": argv})
    (tmp / "cases.json").write_text(json.dumps(cases))
    # on 2 cores (the runner pinned to them): engine_tp_beyond_machine's 4 TP workers cannot each
    # have a core whatever the machine (every case fails before anything heavy runs)
    two = sorted(os.sched_getaffinity(0))[:2]
    proc = run_py(["tests/e2e/bad_input_runner.py", str(tmp / "cases.json"), str(tmp / "out.json")], timeout=600,
                  preexec_fn=lambda: os.sched_setaffinity(0, two))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp, json.loads((tmp / "out.json").read_text()), port


@pytest.mark.parametrize("cid,args,named", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_one_clear_line(results, cid, args, named):
    tmp, out, _ = results
    r = out[cid]
    assert "Traceback" not in r["stderr"], r["stderr"][-3000:]
    assert r["rc"] == 2, r
    lines = [line for line in r["stderr"].splitlines() if line.strip()]
    assert any(named in line for line in lines), r["stderr"]
    assert not (tmp / "runs" / cid).exists(), "a failed start wrote into its run dir"


@pytest.mark.parametrize("cid,args,named", LATE, ids=[c[0] for c in LATE])
def test_unreachable_engine_says_what_it_waits_for_and_names_the_url(results, cid, args, named):
    tmp, out, port = results
    r = out[cid]
    url = named.format(port=port)
    assert "Traceback" not in r["stderr"], r["stderr"][-3000:]
    assert r["rc"] == 2, r
    lines = [line for line in r["stderr"].splitlines() if line.strip()]
    waits = [line for line in lines if line.startswith("megarl: waiting for engine") and url in line]
    assert waits and all("rollout.engines.urls" in line for line in waits), r["stderr"]
    (error,) = [line for line in lines if line.startswith("megarl: engine error")]
    assert url in error and "rollout.engines.urls" in error and "rollout.engines.start_timeout_s" in error
    run_dir = tmp / "runs" / cid
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()


def test_debug_shows_the_traceback(tmp_path):
    proc = run_py(["-m", "megarl.cli", "train", "recipes/tiny_cpu.yaml", "train.stepz=3"],
                  env={"MEGARL_DEBUG": "1"}, timeout=120)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "train.stepz" in proc.stderr


def test_the_table_is_big_enough():
    assert len(CASES) >= 60 and len({c[0] for c in CASES + LATE}) == len(CASES + LATE)
