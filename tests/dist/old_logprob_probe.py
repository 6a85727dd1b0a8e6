"""Subprocess body of test_old_logprobs: the carry's l_old and the `kl` metric on real ranks.

Run under torchrun (2 gloo ranks = DP 2) or alone. Replays the recorded tiny rollout:
- carry: `trainer_logprobs` over 61 samples (a count no micro-batch size divides), given only
  on rank 0 as the driver does, against the same forward over all rows on one rank (each rank
  computes that reference alone, without collectives); the model's forward calls are counted.
- kl: a GRPO step on 32 samples whose first tokens carry a stored l_old (stitching) far from
  the current weights' logprob; the `kl` metric must be the k1 estimate of the current weights
  against the reference for every algo.kl_kind, as computed here before the step.
Writes (rank 0) OUT_JSON.
usage: old_logprob_probe.py MODEL_DIR OUT_JSON
"""
import json
import sys

import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)


def main(model_dir: str, out_path: str) -> None:
    from megarl.config import load_config, validate_world
    from megarl.distributed import parallel
    from megarl.distributed.env import init_distributed
    cfg = load_config("recipes/tiny_cpu.yaml", [
        f"model.path={model_dir}", "algo.name=grpo", "algo.kl_coef=0.001", "rollout.sampling.n=4",
        "train.groups_per_step=8",
        "train.mini_batches=2", "train.micro_batch_size=8", "rollout.sampling.temperature=0.7"])
    env = init_distributed()
    validate_world(cfg, env.world_size)
    bootstrap()
    torch.set_num_threads(1)
    parallel.initialize(1, 1, cfg.run.seed)
    import torch.distributed as dist

    from megarl.models.setup import build_all
    from megarl.ppo import actor as actor_ops
    from megarl.ppo.batch import build_batch
    from megarl.ppo.losses import kl_penalty, masked_mean
    from megarl.ppo.step import ppo_step, trainer_logprobs
    from megarl.rollout.controller.dump import read_samples

    models = build_all(cfg)
    pad, vocab, temp = models.tokenizer.pad_token_id, models.actor.info.vocab_size, cfg.rollout.sampling.temperature
    actor = models.actor.model
    with torch.no_grad():   # the actor one step away from the reference: a KL that is not 0
        gen = torch.Generator().manual_seed(1)
        for p in actor.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    samples = read_samples("tests/data/rollout_tiny.jsonl")
    result = {"rank": env.rank, "world": env.world_size}

    # --- the carry: DP split + full micro-batches vs one rank, every row, micro-batch 1
    carry = samples[:61]
    calls = []
    hook = actor.register_forward_hook(lambda mod, args, out: calls.append(int(args[0].shape[0])))
    got = trainer_logprobs(cfg, models.actor, carry if env.rank == 0 else None, pad)
    hook.remove()
    full = actor_ops.logprobs(actor, build_batch(carry, pad), 1, vocab, temp)
    want = [full[i, :len(s.response_ids)].tolist() for i, s in enumerate(carry)]
    result["carry"] = {"count": len(got), "lengths_ok": [len(a) for a in got] == [len(b) for b in want],
                       "max_abs_diff": max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x, y)),
                       "forward_rows": calls}
    result["carry_empty"] = trainer_logprobs(cfg, models.actor, [] if env.rank == 0 else None, pad)

    # --- the kl metric with stitched l_old, per kl_kind
    batch_samples = samples[:32]
    cur = actor_ops.logprobs(actor, build_batch(batch_samples, pad), 8, vocab, temp)
    for i, s in enumerate(batch_samples):   # a stored l_old far from today's for the first 2 tokens
        s.old_logprobs = [v - 0.7 for v in cur[i, :min(2, len(s.response_ids))].tolist()]
    batch = build_batch(batch_samples, pad)
    result["kl"] = {}
    for kind in ("k1", "k3", "k2", "abs"):
        cur = actor_ops.logprobs(actor, batch, 8, vocab, temp)
        ref = actor_ops.logprobs(models.reference, batch, 8, vocab, temp)
        expected = float(masked_mean(kl_penalty(cur, ref, "k1") * batch.resp_mask, batch.resp_mask))
        cfg.algo.kl_kind = kind
        metrics = ppo_step(cfg, models.actor, models.reference, models.critic, batch, 0)
        result["kl"][kind] = {"metric": metrics["kl"], "expected": expected}
    result["no_reference"] = without_reference(cfg, batch)
    gathered = [None] * env.world_size if env.world_size > 1 else None
    if env.world_size > 1:
        dist.gather_object(result, gathered if env.rank == 0 else None, dst=0)
    if env.rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered or [result], f)
    parallel.destroy()


def without_reference(cfg, batch) -> dict:
    """algo.kl_coef=0: the models build_all makes (megatron GPTModels created, counted by their
    constructor) and the step's metrics; with a KL term for comparison."""
    import dataclasses

    from megatron.core.models.gpt import GPTModel

    from megarl.models.setup import build_all
    from megarl.ppo.step import ppo_step
    made = []
    original = GPTModel.__init__

    def counting(self, *a, **kw):
        made.append(1)
        original(self, *a, **kw)
    out = {}
    GPTModel.__init__ = counting
    try:
        for name, coef in (("kl0", 0.0), ("kl", 0.001)):
            c = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, kl_coef=coef, kl_kind="k1"))
            made.clear()
            models = build_all(c, with_tokenizer=False)
            metrics = ppo_step(c, models.actor, models.reference, models.critic, batch, 0)
            out[name] = {"models_built": len(made), "reference": models.reference is not None,
                         "keys": sorted(metrics), "policy_loss": metrics["policy_loss"]}
    finally:
        GPTModel.__init__ = original
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
