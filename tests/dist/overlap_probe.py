"""Subprocess body of test_overlap: two training steps through `Trainer.generate` / `update`
with rollout.overlap, on real megatron ranks (gloo), against the same passes after the round.

The round is a stand-in (`ScriptedRound`, no engine): `round(step, during)` calls `during`
with a `finished` that ends the round after a scripted number of polls and an `emitted` that
shows the groups complete by that poll, then returns the step's groups in the order the
controller would hand them out. Step 0 trains groups [3, 0, 5, 2] of the 7 emitted (0, 1 at
poll 1, 2, 3, 4 at poll 3, 5, 6 only at the end: 5 is computed after the round); step 1
trains [1, 4, 6, 7] (1 and 4 keep their reference logprobs and reward-model scores from round
0, 7 arrives at the end). Modes (one per `--case`):
- overlap: as above;
- after: rollout.overlap on, but `during` finds the round over at once: every pass after it;
- plain: rollout.overlap off (today's whole-batch passes).
Writes (rank 0) OUT_JSON: {case: {"steps": [{metrics, "weights": sha256 of each rank's actor +
critic shards, "actor_rows": rows rank 0's actor forward ran on during update}], "initial": ...}}.
usage: overlap_probe.py MODEL_DIR RM_DIR OUT_JSON --case NAME MODE key=value... [--case ...]
"""
import hashlib
import json
import random
import sys

import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)

N = 4
# step: (groups trained, in hand-out order; {poll: groups complete by then}; polls until done)
SCRIPT = {0: ([3, 0, 5, 2], {1: [0, 1], 3: [0, 1, 2, 3, 4]}, 4, [0, 1, 2, 3, 4, 5, 6]),
          1: ([1, 4, 6, 7], {1: [1, 4], 2: [1, 4, 6]}, 3, [1, 4, 6, 7])}


def synthetic_groups(vocab: int) -> dict:
    """8 groups of N samples, ragged: each group's longest row differs (its own padded length)."""
    from megarl.data.sample import Sample
    rng = random.Random(7)
    groups = {}
    for g in range(8):
        prompt = [1] + [rng.randrange(5, vocab) for _ in range(rng.randrange(2, 7))]
        samples = []
        for _ in range(N):
            length = rng.randrange(1, 6 + 3 * g)
            resp = [rng.randrange(5, vocab) for _ in range(length)]
            samples.append(Sample(prompt, resp, [-2.0 + 0.01 * j for j in range(length)], [0] * length,
                                  True, 0, reward=rng.random(), uid=100 + g))
        groups[g] = samples
    return groups


class ScriptedRound:
    """The driver's `Rollout` as `Trainer.generate` uses it, playing SCRIPT."""

    def __init__(self, groups: dict, overlap: bool):
        self.groups, self.overlap = groups, overlap

    def round(self, step: int, during=None):
        chosen, shown, polls, at_end = SCRIPT[step]
        if during is not None:
            state = {"poll": 0}

            def finished(timeout):
                state["poll"] += 1
                return not self.overlap or state["poll"] >= polls

            def emitted(seen):
                done = at_end if state["poll"] >= polls else \
                    max(([g for p, g in shown.items() if p <= state["poll"]]), key=len, default=[])
                fresh = [[_copy(s) for s in self.groups[g]] for g in done if 100 + g not in seen]
                return [100 + g for g in done], fresh
            during(finished, emitted)
        samples = []
        for i, g in enumerate(chosen):
            for s in self.groups[g]:
                c = _copy(s)
                c.group = i
                samples.append(c)
        return samples, {}

    def pending(self):
        return []

    def prefetch(self, step):
        pass


def _copy(s):
    from dataclasses import replace
    return replace(s, prompt_ids=list(s.prompt_ids), response_ids=list(s.response_ids))


def weights_sha(*models) -> list[str]:
    """sha256 of this rank's shard of every parameter, of each rank (in rank order)."""
    import torch.distributed as dist
    h = hashlib.sha256()
    for m in models:
        for p in m.parameters():
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [h.hexdigest()]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, h.hexdigest())
    return out


def run_case(model_dir: str, rm_dir: str, mode: str, overrides: list[str], rank: int) -> dict:
    from megarl.config import load_config
    from megarl.distributed import parallel
    from megarl.distributed.env import from_rank0
    from megarl.models.setup import build_all
    from megarl.train import Trainer, _overlap
    cfg = load_config("recipes/tiny_cpu.yaml", [
        f"model.path={model_dir}", f"reward.model_path={rm_dir}", "reward.model_coef=0.5",
        f"rollout.sampling.n={N}", "train.groups_per_step=4", "train.micro_batch_size=2", "train.mini_batches=2",
        "algo.kl_coef=0.05", "rollout.dump_every=0", "train.steps=2", "train.actor_lr=2e-4", "train.critic_lr=2e-4",
        f"rollout.overlap={'false' if mode == 'plain' else 'true'}", *overrides])
    parallel.initialize(cfg.parallel.tp, cfg.parallel.pp, cfg.run.seed)
    t = Trainer(cfg)
    t.models = build_all(cfg)
    t.tokenizer, t.is_driver = t.models.tokenizer, rank == 0
    if cfg.rollout.overlap:
        t.overlap = _overlap(cfg, t.models, t.tokenizer.pad_token_id)
    t.rollout = ScriptedRound(synthetic_groups(t.models.actor.info.vocab_size), overlap=mode == "overlap")
    models = [t.models.actor.model, t.models.critic.model]
    out = {"initial": weights_sha(*models), "steps": []}
    for step in (0, 1):
        samples, partials, _ = t.generate(step)
        samples = from_rank0(samples)
        rows = []
        hook = t.models.actor.model.register_forward_hook(lambda mod, a, o, rows=rows: rows.append(int(a[0].shape[0])))
        _, metrics = t.update(step, samples, partials)
        hook.remove()
        out["steps"].append({"metrics": {k: float(v) for k, v in metrics.items() if k != "overlap_forward_s"},
                             "weights": weights_sha(*models), "actor_rows": sum(rows)})
    parallel.destroy()
    return out


def main(model_dir: str, rm_dir: str, out_path: str, args: list[str]) -> None:
    from megarl.distributed import cpu
    from megarl.distributed.env import init_distributed
    env = init_distributed()
    cpu.apply()
    torch.set_num_threads(1)
    cases, it = {}, iter(args)
    for a in it:
        if a == "--case":
            current = cases.setdefault(next(it), [next(it)])
        else:
            current.append(a)
    out = {name: run_case(model_dir, rm_dir, a[0], a[1:], env.rank) for name, a in cases.items()}
    if env.rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
