"""Subprocess body of the layout-equivalence tests: run under torchrun (or alone).

Builds actor, reference and critic from the tiny model at the launched layout, runs
`steps` PPO steps on one fixed synthetic batch (no engine: the batch is generated from a
seed, so every layout sees identical data), and writes per-step losses, gradient norms and
the actor's post-step logprobs to argv[2] (rank 0); the first step's record also holds
`logp_start`, the actor's logprobs at the weights the run starts from (before any update).
tests/dist/parity.py says how close two runs must be.
usage: layout_probe.py MODEL_DIR OUT_JSON key=value... [save=DIR] [resume=DIR] [stale=1]
                       [threads=N] [swap_rows=PARAM]
       layout_probe.py MODEL_DIR OUT_JSON --case NAME key=value... [--case NAME key=value...]
`stale=1` makes the batch off-policy, as rollout.lag or the partial carry make it: every token
gets a stored l_old (and behaviour logprob) of the starting weights' logprob plus seeded noise
(sd 0.3), so the ratio starts away from 1 and the stale-data stabilizers act.
`save=DIR` writes a checkpoint after the last step; `resume=DIR` loads the newest one first
and continues from the step after it (at whatever layout this run was launched with).
`threads=N` runs the case on N intra-op threads (default 1): the same computation in another
reduction order, which is how the tests measure fp32 noise on one machine.
`swap_rows=PARAM` swaps rows 0 and 1 of the last TP shard of every weight named ...PARAM on the
first pipeline stage (actor, reference and critic; after a resume, in the loaded weights): a
deliberately wrong shard, which every parity comparison must catch.
With `--case`, the cases run one after the other in the same ranks (the models are built
anew for each; the world is shared, so they are layouts of the same world size) and OUT_JSON
maps each NAME to its history: one launch instead of one per case, as each launch spends
most of its time importing torch and megatron in every rank.
"""
import json
import random
import sys

import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)


def synthetic_samples(seed: int, groups: int, n: int, vocab: int):
    from megarl.data.sample import Sample
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [1] + [rng.randrange(5, vocab) for _ in range(rng.randrange(2, 6))]
        for _ in range(n):
            length = rng.randrange(1, 12)   # ragged lengths: padding must not matter
            resp = [rng.randrange(5, vocab) for _ in range(length)]
            samples.append(Sample(prompt, resp, [-2.0] * length, [0] * length, True, g,
                                  reward=rng.random()))
    return samples


#: what the stale-data stabilizers report (megarl/ppo/step.py `stabilize`, ppo/grad_align.py)
STABILIZER_METRICS = ("m2po_masked_frac", "m2po_m2", "bapo_low", "bapo_high", "bapo_share",
                      "grad_cosine", "grad_align_corrected_frac")


def stale(samples, batch, models, cfg):
    """The samples with l_old = behaviour logprob = the starting weights' logprob + N(0, 0.3)
    per token (seeded: the same on every layout)."""
    from megarl.ppo import actor as actor_ops
    from megarl.ppo.microbatch import batching_of
    from megarl.ppo.schedule import forward_all
    logp = forward_all(lambda mm, b, s: actor_ops.logprobs(mm, b, s, models.actor.info.vocab_size),
                       models.actor.model, batch, batching_of(cfg))
    gen = torch.Generator().manual_seed(99)
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        values = (logp[i, :n].double() + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)).tolist()
        s.old_logprobs, s.logprobs = values, list(values)
    return samples


def run_case(model_dir: str, args: list[str], world_size: int) -> list[dict]:
    from megarl.config import load_config, validate_world
    from megarl.distributed import parallel
    probe_args = ("save=", "resume=", "stale=", "threads=", "swap_rows=")
    extra = dict(a.split("=", 1) for a in args if a.startswith(probe_args))
    overrides = [a for a in args if not a.startswith(probe_args)]
    cfg = load_config("recipes/tiny_cpu.yaml", [
        f"model.path={model_dir}", "train.groups_per_step=8", "rollout.sampling.n=4", "train.mini_batches=2",
        "train.micro_batch_size=4", "algo.is_mode=none", "train.actor_lr=2e-4", "train.critic_lr=2e-4",
        *overrides])
    validate_world(cfg, world_size)
    parallel.initialize(cfg.parallel.tp, cfg.parallel.pp, cfg.run.seed, cfg.parallel.ep)
    from megarl.models.setup import build_all
    from megarl.ppo import actor as actor_ops
    from megarl.ppo.batch import build_batch
    from megarl.ppo.microbatch import batching_of
    from megarl.ppo.schedule import forward_all
    from megarl.ppo.step import ppo_step

    torch.set_num_threads(int(extra.get("threads", 1)))
    models = build_all(cfg)
    steps = int(dict(o.split("=") for o in overrides).get("train.steps", 3))
    samples = synthetic_samples(1234, 8, 4, models.actor.info.vocab_size)
    batch = build_batch(samples, 0)
    if extra.get("stale") == "1":
        batch = build_batch(stale(samples, batch, models, cfg), 0)
    from megarl.checkpoint import manager as ckpt
    history, start = [], 0
    if "resume" in extra:
        start = ckpt.load(ckpt.complete_checkpoints(extra["resume"])[-1], models.actor, models.critic)["step"] + 1
    if "swap_rows" in extra:
        swap_rows(models, extra["swap_rows"])

    def actor_logp() -> list[float]:
        logp = forward_all(lambda mm, b, s: actor_ops.logprobs(mm, b, s, models.actor.info.vocab_size),
                           models.actor.model, batch, batching_of(cfg))
        return logp[batch.resp_mask > 0].tolist()

    first = {"logp_start": actor_logp()}
    for step in range(start, steps):
        m = ppo_step(cfg, models.actor, models.reference, models.critic, batch, step)
        history.append({k: m[k] for k in ("policy_loss", "value_loss", "grad_norm", "critic_grad_norm")}
                       | {k: m[k] for k in STABILIZER_METRICS if k in m}
                       | {k: v for k, v in m.items() if k.startswith("moe_")}   # an MoE actor's routers
                       | {"logp": actor_logp()} | (first if step == start else {}))
    if "save" in extra:
        ckpt.save(extra["save"], steps - 1, models.actor, models.critic, {"step": steps - 1}, "", keep=1)
    parallel.destroy()
    return history


def swap_rows(models, suffix: str) -> None:
    """Rows 0 and 1 of this rank's shard of every weight whose name ends with `suffix`, swapped
    in place (the optimizer's shards are views of the same storage), on the last TP rank of the
    first pipeline stage: one wrong TP shard at any layout (at TP=1, the only shard)."""
    from megarl.distributed import parallel
    if not (parallel.is_first_stage() and parallel.tp_rank() == parallel.tp_size() - 1):
        return
    hits = 0
    for module in (models.actor.model, models.reference, models.critic and models.critic.model):
        for name, p in module.named_parameters() if module is not None else ():
            if name.endswith(suffix):
                with torch.no_grad():
                    p[[0, 1]] = p[[1, 0]].clone()
                hits += 1
    if not hits:
        raise SystemExit(f"layout_probe: swap_rows={suffix!r} names no weight of the first stage")


def split_cases(args: list[str]) -> dict[str, list[str]] | None:
    """`--case NAME a b --case NAME2 c` -> {NAME: [a, b], NAME2: [c]}; None without --case."""
    if "--case" not in args:
        return None
    if args[0] != "--case":
        raise SystemExit(f"layout_probe: {args[0]!r} before the first --case")
    cases, it = {}, iter(args)
    for a in it:
        if a == "--case":
            current = cases.setdefault(next(it), [])
        else:
            current.append(a)
    return cases


def probe_main(run_case, model_dir: str, out_path: str, args: list[str]) -> None:
    """The probes' main: the ranks' process group and CPU patches, one intra-op thread, then
    `run_case(model_dir, case_args, world_size)` for each --case (or once over `args` without
    one); rank 0 writes the results to `out_path` as JSON."""
    from megarl.distributed import cpu
    from megarl.distributed.env import init_distributed
    env = init_distributed()
    cpu.apply()
    torch.set_num_threads(1)
    cases = split_cases(args)
    if cases is None:
        out = run_case(model_dir, args, env.world_size)
    else:
        out = {name: run_case(model_dir, case_args, env.world_size) for name, case_args in cases.items()}
    if env.rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    probe_main(run_case, sys.argv[1], sys.argv[2], sys.argv[3:])
