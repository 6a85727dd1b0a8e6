"""Subprocess body of test_damaged_checkpoint: real megatron checkpoints, then damaged.

One process (tp=1, gloo). Saves step_0 and step_1 of a PPO run's models (actor, critic,
optimizers), then: both intact; a shard file of step_1's actor deleted (what resume picks,
the warning, and that the picked one loads); a shard of step_0's critic cut short too (every
one damaged); driver.pt cut short. Writes OUT_JSON.
usage: checkpoint_probe.py MODEL_DIR OUT_DIR
"""
import json
import sys
from pathlib import Path

import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)


def main(model_dir: str, out_dir: str) -> None:
    from megarl.config import ConfigError, load_config
    from megarl.distributed import parallel
    from megarl.distributed.env import init_distributed
    cfg = load_config("recipes/tiny_cpu.yaml", [f"model.path={model_dir}", "algo.name=ppo"])
    init_distributed()
    bootstrap()
    torch.set_num_threads(1)
    parallel.initialize(1, 1, cfg.run.seed)
    from megarl.checkpoint import manager as ckpt
    from megarl.models.setup import build_all

    models = build_all(cfg)
    from megarl.ppo.batch import build_batch
    from megarl.ppo.step import ppo_step
    from megarl.rollout.controller.dump import read_samples
    # one update first: a fresh optimizer has no state to save
    ppo_step(cfg, models.actor, models.reference, models.critic,
             build_batch(read_samples("tests/data/rollout_tiny.jsonl"), models.tokenizer.pad_token_id), 0)
    root = Path(out_dir) / "checkpoints"
    for step in (0, 1):
        ckpt.save(root, step, models.actor, models.critic, {"step": step, "version": step + 1}, "x: 1\n", 3)
    result = {"files": sorted(str(p.relative_to(root / "step_1")) for p in (root / "step_1").rglob("*")
                              if p.is_file()),
              "intact": [ckpt.checkpoint_problem(p) for p in ckpt.complete_checkpoints(root)]}
    warnings = []
    result["intact_pick"] = ckpt.resume_point(root, warnings.append).name

    shard = sorted((root / "step_1" / "actor").glob("*.distcp"))[0]
    shard.unlink()
    result["missing_shard"] = shard.name
    result["missing_problem"] = ckpt.checkpoint_problem(root / "step_1")
    warnings = []
    picked = ckpt.resume_point(root, warnings.append)
    result["missing_pick"], result["missing_warnings"] = picked.name, warnings
    result["loaded_step"] = ckpt.load(picked, models.actor, models.critic)["step"]

    cut = sorted((root / "step_0" / "critic").glob("*.distcp"))[0]
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size // 2)
    result["cut_problem"] = ckpt.checkpoint_problem(root / "step_0")
    try:
        ckpt.resume_point(root, warnings.append)
        result["all_damaged"] = None
    except ConfigError as err:
        result["all_damaged"] = str(err)

    driver = root / "step_0" / "driver.pt"
    with open(driver, "r+b") as f:
        f.truncate(driver.stat().st_size // 2)
    cut.unlink()
    (root / "step_0" / "critic" / ".metadata").write_bytes(b"garbage")
    result["metadata_problem"] = ckpt.checkpoint_problem(root / "step_0")
    (root / "step_0" / "critic").rename(root / "step_0" / "critic_gone")
    result["driver_problem"] = ckpt.checkpoint_problem(root / "step_0")
    (Path(out_dir) / "out.json").write_text(json.dumps(result))
    parallel.destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
