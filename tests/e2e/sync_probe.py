"""Subprocess body of test_weight_sync: real megatron actor + real vLLM engine, world size 1.

Measures engine-vs-trainer logprob gaps (1) after the initial push, (2) after a PPO update
whose push is deliberately skipped, (3) after the push. Writes them as JSON to argv[2].
"""
import json
import sys

from megarl.config import load_config


def main(model_dir: str, out_path: str) -> None:
    cfg = load_config("recipes/tiny_cpu.yaml", [
        f"model.path={model_dir}", f"data.prompts={model_dir}/prompts.jsonl", "train.steps=1",
        "train.actor_lr=3e-3", "train.groups_per_step=8", "train.micro_batch_size=8",
        "train.mini_batches=1", "algo.name=grpo", "run.dir=unused"])
    from megarl.distributed import cpu, parallel
    from megarl.distributed.env import init_distributed

    init_distributed()
    cpu.apply()
    parallel.initialize(1, 1, cfg.run.seed)
    from megarl.data.prompts import load_jsonl
    from megarl.models.setup import build_all
    from megarl.ppo.batch import build_batch
    from megarl.ppo.step import ppo_step
    from megarl.rewards import get_reward_fn
    from megarl.rollout import weight_sync
    from megarl.rollout.sync_rollout import encode_prompts, generate_groups
    from megarl.rollout.vllm_engine import VLLMEngine

    models = build_all(cfg)
    engine = VLLMEngine(cfg.model.path, cfg.rollout, cfg.run.seed)
    folder = weight_sync.staging_dir(cfg.weight_sync.staging_dir, "probe")
    records = load_jsonl(cfg.data.prompts, "prompt")[:8]
    prompts = encode_prompts(models.tokenizer, records, "prompt")
    gap = lambda: weight_sync.engine_mismatch(models.actor, engine, prompts, 24, 8)  # noqa: E731

    weight_sync.push(models.actor.model, models.actor.info, engine, 0, folder, 1)
    result = {"after_initial_push": gap()}
    samples = generate_groups(engine, records, prompts, cfg.rollout.n, 24, models.tokenizer,
                              get_reward_fn("countdown"))
    ppo_step(cfg, models.actor, models.reference, None, build_batch(samples, 0), 0)
    result["push_skipped"] = gap()
    try:
        weight_sync.verify(models.actor, engine, prompts, 24, 8)
        result["verify_raised"] = False
    except weight_sync.WeightSyncError as err:
        result["verify_raised"] = True
        result["verify_message"] = str(err)
    result["sync"] = weight_sync.push(models.actor.model, models.actor.info, engine, 1, folder, 1)
    result["after_push"] = gap()
    result["engine_version"] = engine.version
    engine.close()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
