"""Subprocess body of test_routing_replay: algo.routing_replay on real ranks (or alone).

Each case builds actor and reference from the tiny random Qwen3-MoE at the launched layout and
runs one GRPO step (one update, KL on: the reference runs) on 16 synthetic samples whose
behaviour logprobs come from a transformers forward of the same weights:
- routes=forced: each sample carries seeded random experts per token and MoE layer
  (Sample.routes, as an engine would report them) and its behaviour logprobs are transformers'
  with its routers forced to those experts (their top-k patched, as tests of megatron's replay
  do); the engine's choices differ from the model's own.
- routes=own: the experts transformers' routers chose themselves, and its plain logprobs.
- routes=none: no Sample.routes; plain transformers logprobs.
- samples=refused_tail (routing replay's filler rule): one sample refused by the engines (no
  response, no routes) and two episodes carried between turns (their last response tokens an
  observation, mask 0, behaviour logprob 0, without routes: rows only up to their last model
  token, as the rollout hands them over).
The step's metrics are written per case (rank 0); for r2 also `recorded_same`: the share of
scored token-layers where the routes recorded in the old-logprob pass (every DP rank's,
gathered) are transformers' own choices; for r3 also `carry_mismatch_max`: the carry's l_old
(trainer_logprobs, partial rollout's stitching) against the behaviour logprobs.
usage: route_replay_probe.py MODEL_DIR OUT_JSON --case NAME routes=KIND [samples=refused_tail] key=value...
       [--case ...]
"""
import functools
import sys

import numpy as np
import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)

from layout_probe import probe_main, synthetic_samples  # noqa: E402

METRICS = ("logprob_mismatch_max", "logprob_mismatch_mean", "ratio_mean", "approx_kl", "kl", "routing_agreement",
           "train_route_bytes", "is_weight_mean", "policy_loss", "grad_norm")


class HFRoutes:
    """transformers' Qwen3-MoE forward with its routers recording their choice, or forced to
    given experts ([T, k] per layer)."""

    def __init__(self, model_dir: str):
        import transformers.models.qwen3_moe.modeling_qwen3_moe as qm
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.layer_of = {id(layer.mlp.gate): i for i, layer in enumerate(self.model.model.layers)}
        self.forced, self.chosen = None, {}
        original = qm.Qwen3MoeTopKRouter.forward
        probe = self

        def forward(router, x):
            logits, weights, idx = original(router, x)
            layer = probe.layer_of[id(router)]
            if probe.forced is not None:
                idx = probe.forced[layer]
                weights = torch.softmax(logits.float().gather(-1, idx), -1).to(logits.dtype)
            probe.chosen[layer] = idx
            return logits, weights, idx
        qm.Qwen3MoeTopKRouter.forward = forward

    def run(self, ids: list[int], temperature: float, forced=None):
        """(logprobs of ids[1:], routes [T - 1, layers, k] the routers used)."""
        self.forced = None if forced is None else [torch.as_tensor(forced[:, j]).long()
                                                   for j in range(forced.shape[1])]
        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0].float() / temperature
        self.forced = None
        logp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        routes = torch.stack([self.chosen[j] for j in range(len(self.chosen))], 1)[:-1]
        return logp.tolist(), routes.numpy().astype(np.uint8)


def make_samples(hf: HFRoutes, kind: str, vocab: int, temperature: float, experts: int, topk: int):
    samples = synthetic_samples(1234, 4, 4, vocab)
    gen = torch.Generator().manual_seed(7)
    for s in samples:
        ids = s.prompt_ids + s.response_ids
        forced = None
        if kind == "forced":
            layers = len(hf.layer_of)
            draw = torch.rand(len(ids), layers, experts, generator=gen).argsort(-1)[..., :topk]
            draw[-1] = torch.arange(topk)   # the last token has no route: the trainer's filler
            forced = draw.numpy()
        logp, routes = hf.run(ids, temperature, forced)
        s.logprobs = logp[len(s.prompt_ids) - 1:]
        s.routes = routes if kind != "none" else None
    return samples


def refused_and_tails(samples: list) -> list:
    """samples=refused_tail: sample 1 refused, samples 2 and 6 with their last response tokens
    an observation (at least one model token stays) and their routes cut after the last model
    token's position (as a slot between turns holds them: its observation was never fed)."""
    from megarl.data.sample import Sample
    s = samples[1]
    samples[1] = Sample(s.prompt_ids, [], [], [], False, s.group, reward=0.0, finish_reason="refused")
    for i in (2, 6):
        s = samples[i]
        model = max(1, len(s.response_ids) // 2)
        obs = len(s.response_ids) - model
        s.mask = [1] * model + [0] * obs
        s.logprobs = s.logprobs[:model] + [0.0] * obs
        if s.routes is not None:   # rows of the prompt and the model turn but its last token
            s.routes = s.routes[:len(s.prompt_ids) + model - 1]
    return samples


def recorded_same(models, cfg, batch, hf, samples) -> float:
    """r2's old-logprob pass on its own: its recorded routes against transformers' own."""
    from megarl.distributed import parallel
    from megarl.ppo import actor as actor_ops
    from megarl.ppo.microbatch import batching_of, plan_batch
    from megarl.ppo.replay_step import StepReplay
    from megarl.ppo.schedule import forward_all
    plan = plan_batch(batch, batching_of(cfg), parallel.dp_size())
    replay = StepReplay("r2", models.actor.model, batch)
    vocab, temp = models.actor.info.vocab_size, cfg.rollout.sampling.temperature
    replay.old_pass(lambda: forward_all(lambda m, b, s: actor_ops.logprobs(m, b, s, vocab, temp),
                                        models.actor.model, replay.batch, plan), plan)
    got, cols = replay.train_batch.routes, replay.control.columns
    same = total = 0
    for i, s in enumerate(samples):
        own = torch.as_tensor(hf.run(s.prompt_ids + s.response_ids, temp)[1]).long()[:, cols]
        rec = got[i, :own.shape[0]].long()
        same += int((rec.sort(-1).values == own.sort(-1).values).all(-1).sum())
        total += own.shape[0] * own.shape[1]
    return same / total


def carry(models, cfg, samples) -> dict:
    """The carry's l_old (trainer_logprobs: samples on global rank 0 only, as the driver holds
    them) against the behaviour logprobs."""
    import torch.distributed as dist

    from megarl.ppo.step import trainer_logprobs
    first = not dist.is_initialized() or dist.get_rank() == 0
    try:
        got = trainer_logprobs(cfg, models.actor, samples if first else None, 0)
    except ValueError as err:
        return {"carry_error": str(err)}
    return {"carry_mismatch_max": max(abs(a - b) for s, values in zip(samples, got)
                                      for a, b, m in zip(values, s.logprobs, s.loss_mask) if m)}


def run_case(model_dir: str, args: list[str], world_size: int, hf: HFRoutes) -> dict:
    from megarl.config import load_config, validate_world
    from megarl.distributed import parallel
    from megarl.models.setup import build_all
    from megarl.ppo.batch import build_batch
    from megarl.ppo.step import ppo_step
    probe = dict(a.split("=", 1) for a in args if a.startswith(("routes=", "samples=")))
    kind = probe.get("routes", "none")
    overrides = [a for a in args if not a.startswith(("routes=", "samples="))]
    cfg = load_config("recipes/tiny_cpu.yaml", [
        f"model.path={model_dir}", "algo.name=grpo", "rollout.sampling.n=4", "train.groups_per_step=4",
        "train.mini_batches=1", "train.micro_batch_size=4", "algo.kl_coef=0.001", "moe.load_balancing=none",
        *overrides])
    validate_world(cfg, world_size)
    parallel.initialize(cfg.parallel.tp, cfg.parallel.pp, cfg.run.seed, cfg.parallel.ep)
    models = build_all(cfg)
    hc = hf.model.config
    samples = make_samples(hf, kind, models.actor.info.vocab_size, cfg.rollout.sampling.temperature,
                           hc.num_experts, hc.num_experts_per_tok)
    if probe.get("samples") == "refused_tail":
        samples = refused_and_tails(samples)
    batch = build_batch(samples, 0)
    out = {}
    if cfg.algo.routing_replay == "r2":
        out["recorded_same"] = recorded_same(models, cfg, batch, hf, samples)
    if cfg.algo.routing_replay == "r3":
        out.update(carry(models, cfg, samples))
    try:
        metrics = ppo_step(cfg, models.actor, models.reference, models.critic, batch, 0)
        out.update({k: metrics[k] for k in METRICS if k in metrics})
    except ValueError as err:   # a refusal is the result of the case
        out["error"] = str(err)
    parallel.destroy()
    return out


@functools.cache
def hf_routes(model_dir: str) -> HFRoutes:
    """One transformers model for every case of the launch, built at the first."""
    return HFRoutes(model_dir)


if __name__ == "__main__":
    probe_main(lambda model_dir, args, world_size: run_case(model_dir, args, world_size, hf_routes(model_dir)),
               sys.argv[1], sys.argv[2], sys.argv[3:])
