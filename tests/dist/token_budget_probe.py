"""Subprocess body of test_token_budget: one launch per world size, several layouts in turn.

Builds actor, reference and critic from the tiny model at each layout (`--case NAME
key=value...`, as layout_probe.py), then on one long-tailed batch (8 groups of 4) (most responses a few tokens,
a few up to 200: the shape partial rollout trains on) runs, for every batching rule in RULES
and every algo.loss_agg mode, one PPO step with the critic (2 mini-batches), and the old
logprobs and the carry's stitched l_old under that rule. The learning rates are 1e-12: an
update moves no weight by a representable amount, so every step of a case starts from the
same weights and its losses and gradient norms are pre-update quantities (free of the
optimizer's fp32 noise), comparable across rules and layouts as tightly as the reduction order
allows. Writes {case: {rule: {...}}} to OUT_JSON (rank 0).
usage: token_budget_probe.py MODEL_DIR OUT_JSON --case NAME [rules=a,b] key=value... [--case ...]
(`rules=`: the rules of RULES a case runs; default all)
"""
import sys

import numpy as np
import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)

from layout_probe import probe_main  # noqa: E402  (tests/dist is the script's directory)

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
#: name: (train.micro_batch_size, train.max_tokens_per_micro_batch, train.remove_padding)
RULES = {"padded": (4, 0, False),    # every row at the batch's longest: the layout before
         "rows": (4, 0, True),       # 4 rows per micro-batch, each padded to its own longest
         "budget": (8, 256, True)}   # as many rows as fit 256 tokens
MAX_NEW = 200
METRICS = ("policy_loss", "value_loss", "grad_norm", "critic_grad_norm", "kl", "advantage_mean", "value_mean",
           "train_padding_frac", "train_tokens_computed", "train_micro_batches", "train_dp_token_imbalance")


def long_tailed_samples(vocab: int, groups: int = 8, n: int = 4, seed: int = 7):
    """groups x n samples, prompts of 2-6 tokens, responses pareto(1.2, xmin 2) tokens capped at
    MAX_NEW, the first one MAX_NEW long (the tail is always there)."""
    from megarl.data.sample import Sample
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(groups):
        prompt = [1] + rng.integers(5, vocab, int(rng.integers(1, 6))).tolist()
        for j in range(n):
            length = int(min(MAX_NEW, round(2 * (1.0 - rng.random()) ** (-1 / 1.2))))
            length = MAX_NEW if g == j == 0 else length
            resp = rng.integers(5, vocab, length).tolist()
            behav = (-2.0 - 0.5 * rng.random(length)).tolist()
            samples.append(Sample(prompt, resp, behav, [0] * length, bool(j % 2), g, reward=float(rng.random())))
    # stitched l_old on the first tokens of every other sample, as partial rollout stores it
    for s in samples[::2]:
        s.old_logprobs = [v + 0.1 for v in s.logprobs[:3]]
    return samples


def fewer_rows_than_ranks(cfg, models, samples) -> dict:
    """Mini-batches of one row (two groups of 4) and a carry of one sample: with DP=2 one rank
    has no row of its own and computes a filler (mask 0: no loss, no gradient, its output
    dropped)."""
    from megarl.ppo.batch import build_batch
    from megarl.ppo.step import ppo_step, trainer_logprobs
    cfg.train.mini_batches, cfg.algo.loss_agg = len(samples), AGGS[0]
    m = ppo_step(cfg, models.actor, models.reference, models.critic, build_batch(samples, 0), 0)
    cfg.train.mini_batches = 2
    return {"step": {k: m[k] for k in METRICS if k in m},
            "carry": trainer_logprobs(cfg, models.actor, samples[:1], 0)[0]}


def perturb(models) -> None:
    """Values and a KL that are not 0 (the critic's head starts at zero, the reference equals
    the actor), the same at every layout: only tensors that no TP or PP split shards (the
    critic's value head, the reference's final norm; on the last stage), from a generator
    seeded the same on every rank."""
    from megarl.distributed import parallel
    if not parallel.is_last_stage():
        return
    gen = torch.Generator().manual_seed(5)
    for model, name, scale in ((models.critic.model, "output_layer.weight", 0.3),
                               (models.reference, "final_layernorm.weight", 0.2)):
        p = next(p for n, p in model.named_parameters() if n.endswith(name))
        with torch.no_grad():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))


def recorder(calls: list):
    """A forward hook appending the input tokens' shape [rows, length] of each call."""
    return lambda module, args, output: calls.append(list(args[0].shape))


def every_rank(value) -> list:
    """[value of global rank 0, of rank 1, ...]."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def set_rule(cfg, rule: str) -> None:
    cfg.train.micro_batch_size, cfg.train.max_tokens_per_micro_batch, cfg.train.remove_padding = RULES[rule]


def run_case(model_dir: str, args: list[str], world_size: int) -> dict:
    from megarl.config import load_config, validate_world
    from megarl.distributed import parallel
    rules = next((a.split("=", 1)[1].split(",") for a in args if a.startswith("rules=")), list(RULES))
    args = [a for a in args if not a.startswith("rules=")]
    cfg = load_config("recipes/tiny_cpu.yaml", [
        f"model.path={model_dir}", "algo.name=ppo", "train.groups_per_step=8", "rollout.sampling.n=4",
        "train.mini_batches=2", "train.micro_batch_size=4", f"rollout.sampling.max_new_tokens={MAX_NEW}",
        "train.actor_lr=1e-12", "train.critic_lr=1e-12", "algo.entropy_coef=0.01", "algo.kl_coef=0.05",
        "algo.kl_mode=loss", *args])
    validate_world(cfg, world_size)
    parallel.initialize(cfg.parallel.tp, cfg.parallel.pp, cfg.run.seed)
    from megarl.models.setup import build_all
    from megarl.ppo import actor as actor_ops
    from megarl.ppo.batch import build_batch
    from megarl.ppo.microbatch import batching_of
    from megarl.ppo.schedule import forward_all
    from megarl.ppo.step import ppo_step, trainer_logprobs

    models = build_all(cfg)
    perturb(models)
    vocab = models.actor.info.vocab_size
    samples = long_tailed_samples(vocab)
    batch = build_batch(samples, 0)
    out = {}
    for rule in rules:
        set_rule(cfg, rule)
        logp = forward_all(lambda m, b, layout: actor_ops.logprobs(m, b, layout, vocab), models.actor.model,
                           batch, batching_of(cfg))
        carry = trainer_logprobs(cfg, models.actor, samples, 0)
        steps, calls = {}, []
        for agg in AGGS:
            cfg.algo.loss_agg = agg
            # the actor's forward calls of the first step on this rank: (rows, length) of each
            hook = models.actor.model.register_forward_hook(recorder(calls)) if agg == AGGS[0] else None
            m = ppo_step(cfg, models.actor, models.reference, models.critic, batch, 0)
            if hook is not None:
                hook.remove()
            steps[agg] = {k: m[k] for k in METRICS if k in m}
        out[rule] = {"steps": steps, "logp": logp[batch.resp_mask > 0].tolist(),
                     "carry": [v for row in carry for v in row], "calls": every_rank(calls)}
        if rule == "budget":
            out["fill"] = fewer_rows_than_ranks(cfg, models, samples[:8])
    parallel.destroy()
    return out


if __name__ == "__main__":
    probe_main(run_case, sys.argv[1], sys.argv[2], sys.argv[3:])
