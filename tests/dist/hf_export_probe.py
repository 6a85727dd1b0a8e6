"""Subprocess bodies of tests/dist/test_hf_export.py.

usage:
  hf_export_probe.py train MODEL_DIR WORK key=value...   (under torchrun, e.g. 4 ranks at TP=2 x PP=2)
      two PPO steps of the trainer on a fixed synthetic batch (layout_probe's), then, collectively:
      the actor exported to WORK/hf (`hf_export.export_actor`, shards of 0.1 MiB), its
      logprobs of the batch's tokens, a second export onto WORK/hf that fails (no config.json
      in its side folder), and a dist checkpoint of the run in WORK/run/checkpoints (config.yaml
      naming model.path) for `megarl export`. Rank 0 writes WORK/train.json.
  hf_export_probe.py engines EXPORT TRAIN_JSON OUT_JSON
      the exported folder in transformers (fp32) and in a vLLM engine (vllm.LLM with megarl's
      engine settings): each one's logprob of every sequence's response tokens (vLLM's prompt
      logprobs), written to OUT_JSON.
"""
import json
import sys
from pathlib import Path

import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)


def train(model_dir: str, work: str, overrides: list[str]) -> None:
    from layout_probe import synthetic_samples
    from omegaconf import OmegaConf

    from megarl.checkpoint import CheckpointError, hf_export
    from megarl.checkpoint import manager as ckpt
    from megarl.config import load_config, validate_world
    from megarl.distributed import cpu, parallel
    from megarl.distributed.env import init_distributed
    from megarl.models.setup import build_all
    from megarl.ppo import actor as actor_ops
    from megarl.ppo.batch import build_batch
    from megarl.ppo.schedule import forward_all
    from megarl.ppo.step import ppo_step

    env = init_distributed()
    cpu.apply()
    torch.set_num_threads(1)
    work = Path(work)
    cfg = load_config("recipes/tiny_cpu.yaml", [
        f"model.path={model_dir}", f"run.dir={work / 'run'}", "train.groups_per_step=8", "rollout.sampling.n=4",
        "train.mini_batches=2", "train.micro_batch_size=4", "algo.is_mode=none", "train.actor_lr=2e-4", *overrides])
    validate_world(cfg, env.world_size)
    parallel.initialize(cfg.parallel.tp, cfg.parallel.pp, cfg.run.seed)
    models = build_all(cfg)
    samples = synthetic_samples(1234, 8, 4, models.actor.info.vocab_size)
    batch = build_batch(samples, 0)
    for step in range(2):
        ppo_step(cfg, models.actor, models.reference, models.critic, batch, step)
    hf_export.export_actor(models.actor.model, models.actor.info, work / "hf", model_dir, 0, step=1)
    logp = forward_all(lambda mm, b, s: actor_ops.logprobs(mm, b, s, models.actor.info.vocab_size),
                       models.actor.model, batch, cfg.train.micro_batch_size)
    try:   # a side folder without config.json: every rank must raise, the export above stays
        hf_export.export_actor(models.actor.model, models.actor.info, work / "hf", work / "nowhere", 0)
        failed = None
    except CheckpointError as err:
        failed = str(err)
    failures = [None] * env.world_size
    torch.distributed.all_gather_object(failures, failed)
    ckpt.save(cfg.checkpoint_dir, 1, models.actor, models.critic, {"step": 1},
              OmegaConf.to_yaml(OmegaConf.structured(cfg)), keep=1)
    if env.rank == 0:
        rows = [{"tokens": s.prompt_ids + s.response_ids, "prompt_len": len(s.prompt_ids),
                 "logp": logp[i, :len(s.response_ids)].tolist()} for i, s in enumerate(samples)]
        (work / "train.json").write_text(json.dumps({"rows": rows, "failed_export": failures}))
    parallel.destroy()


def engines(export: str, train_json: str, out_json: str) -> None:
    from transformers import AutoModelForCausalLM
    rows = json.loads(Path(train_json).read_text())["rows"]
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    hf = []
    with torch.no_grad():
        for r in rows:
            tokens = torch.tensor([r["tokens"]])
            logp = torch.log_softmax(model(input_ids=tokens).logits[0].double(), -1)
            targets = tokens[0, r["prompt_len"]:]
            hf.append(logp[r["prompt_len"] - 1:-1].gather(1, targets[:, None])[:, 0].tolist())
    del model
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from megarl.rollout.engines.vllm_settings import engine_settings
    settings = engine_settings(seed=0, max_model_len=256, tp=1, enforce_eager=True, kv_cache_mb=64,
                               gpu_memory_utilization=0.5, cuda=False)
    llm = LLM(model=export, **settings)
    outs = llm.generate([TokensPrompt(prompt_token_ids=r["tokens"]) for r in rows],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    vl = []
    for r, o in zip(rows, outs):
        per_pos = o.prompt_logprobs   # [None, {token: Logprob}, ...] for the prompt's tokens
        vl.append([per_pos[p][r["tokens"][p]].logprob for p in range(r["prompt_len"], len(r["tokens"]))])
    Path(out_json).write_text(json.dumps({"transformers": hf, "vllm": vl}))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))   # layout_probe's synthetic batch
    if sys.argv[1] == "train":
        train(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        engines(sys.argv[2], sys.argv[3], sys.argv[4])
