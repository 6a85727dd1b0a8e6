"""Subprocess body of the device-placement test: run under torchrun (or alone).

Replays the recorded tiny rollout (tests/data/rollout_tiny.jsonl) through what a training
step does on the trainer ranks, PPO (actor, critic, reference) and GRPO, inside
`DeviceGuard`: every tensor megarl makes for the models must be on the trainer's device, as a
GPU run needs. Then, per field named in `leave=a,b`, the same PPO step with that one batch
field left on the host, which the guard must refuse. Writes (rank 0) to OUT_JSON:
{"clean": {algo: metrics}, "syncs": {algo: n}, "left": {field: error message or null}}.
usage: device_probe.py MODEL_DIR OUT_JSON [leave=f1,f2] key=value...
"""
import json
import sys

import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)


def main(model_dir: str, out_path: str, args: list[str]) -> None:
    from megarl.config import load_config, validate_world
    leave = [a.split("=", 1)[1] for a in args if a.startswith("leave=")]
    leave = leave[0].split(",") if leave and leave[0] else []
    overrides = [a for a in args if not a.startswith("leave=")]
    cfg = load_config("recipes/tiny_cpu.yaml", [
        f"model.path={model_dir}", "rollout.sampling.n=4", "train.mini_batches=2", "train.micro_batch_size=4",
        *overrides])
    from megarl.distributed import parallel
    from megarl.distributed.env import init_distributed
    env = init_distributed()
    validate_world(cfg, env.world_size)
    bootstrap()
    torch.set_num_threads(1)
    parallel.initialize(cfg.parallel.tp, cfg.parallel.pp, cfg.run.seed)
    from megarl.distributed.device_guard import HOST, DeviceGuard, MixedDeviceError, mark
    from megarl.distributed.stop import StopSignal
    from megarl.models.setup import build_all
    from megarl.ppo.batch import build_batch
    from megarl.ppo.step import ppo_step, trainer_logprobs
    from megarl.rollout.controller.dump import read_samples
    from megarl.rollout.weights import files

    samples = read_samples("tests/data/rollout_tiny.jsonl")
    result = {"clean": {}, "syncs": {}, "left": {}}
    for algo in ("ppo", "grpo"):
        cfg.algo.name = algo
        models = build_all(cfg)
        pad = models.tokenizer.pad_token_id
        with DeviceGuard() as guard:
            # the step's trainer-side work, in train.py's order
            trainer_logprobs(cfg, models.actor, samples[:3], pad)
            batch = build_batch(samples, pad)
            result["clean"][algo] = ppo_step(cfg, models.actor, models.reference, models.critic, batch, 0)
            files.push(models.actor.model, models.actor.info, None, 1, cfg.weight_sync.staging_dir,
                             cfg.weight_sync.bucket_mb, "probe")
            StopSignal(0).should_stop()
        result["syncs"][algo] = guard.syncs
        result.setdefault("sync_sites", {})[algo] = guard.sync_sites
    for field in leave:
        with DeviceGuard():
            batch = build_batch(samples, pad)
            setattr(batch, field, mark(getattr(batch, field).clone(), HOST))
            try:
                ppo_step(cfg, models.actor, models.reference, models.critic, batch, 1)
                result["left"][field] = None
            except MixedDeviceError as err:
                result["left"][field] = str(err)
    if env.rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    parallel.destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
