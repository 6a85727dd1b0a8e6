"""Subprocess body of test_nonfinite: NaN/Inf before the optimizer step, on the real trainer.

One process (tp=1), the recorded tiny rollout. Cases: a NaN reward with train.on_nonfinite=
stop and =skip, and a NaN loss (so NaN gradients) with stop. For each: what happened, and
whether the actor's weights changed. Writes OUT_JSON.
usage: nonfinite_probe.py MODEL_DIR OUT_JSON
"""
import json
import math
import sys

import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)


def main(model_dir: str, out_path: str) -> None:
    from megarl.config import load_config
    from megarl.distributed import parallel
    from megarl.distributed.env import init_distributed
    cfg = load_config("recipes/tiny_cpu.yaml", [f"model.path={model_dir}", "rollout.sampling.n=4",
                                                "train.mini_batches=2", "train.micro_batch_size=8", "algo.name=ppo"])
    init_distributed()
    bootstrap()
    torch.set_num_threads(1)
    parallel.initialize(1, 1, cfg.run.seed)
    from megarl.config.registry import POLICY_LOSSES
    from megarl.models.setup import build_all
    from megarl.ppo.batch import build_batch
    from megarl.ppo.losses import policy_loss
    from megarl.ppo.nonfinite import NonFiniteError
    from megarl.ppo.step import ppo_step
    from megarl.rollout.controller.dump import read_samples

    models = build_all(cfg)
    samples = read_samples("tests/data/rollout_tiny.jsonl")[:32]

    def weights():
        return float(sum(p.detach().double().abs().sum() for p in models.actor.model.parameters()))

    POLICY_LOSSES.register("nan_probe", lambda *a, **k: (lambda pt, st: (pt * float("nan"), st))(*policy_loss(*a, **k)))

    def case(policy, nan_reward=False, nan_loss=False):
        cfg.train.on_nonfinite = policy
        batch = build_batch(samples, models.tokenizer.pad_token_id)
        if nan_reward:
            batch.scores[5] = float("nan")
        # a NaN loss: the built-in clipped loss times NaN, chosen as algo.policy_loss by its name
        cfg.algo.policy_loss = "nan_probe" if nan_loss else "ppo"
        before = weights()
        try:
            metrics = ppo_step(cfg, models.actor, models.reference, models.critic, batch, 3)
            outcome = {"metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}}
        except NonFiniteError as err:
            outcome = {"error": str(err)}
        finally:
            cfg.algo.policy_loss = "ppo"
        outcome["weights_changed"] = weights() != before
        return outcome

    result = {"reward_stop": case("stop", nan_reward=True), "reward_skip": case("skip", nan_reward=True),
              "loss_stop": case("stop", nan_loss=True), "clean": case("stop")}
    assert math.isfinite(weights())
    with open(out_path, "w") as f:
        json.dump(result, f)
    parallel.destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
