"""One PPO/GRPO optimisation step on a rollout batch, on every trainer rank.

Every rank holds the whole batch. Forward-only passes run on this DP rank's rows and are
gathered back, so advantages are computed identically everywhere; updates then take each
mini-batch's DP share. Order (docs/design.md "One training step"): old and reference logprobs,
values -> rewards (score + KL penalty) -> advantages -> behaviour IS weights -> updates.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist

from megarl.config.registry import ADVANTAGES
from megarl.config.schema import RootConfig
from megarl.data.seeds import minibatch_seed
from megarl.distributed import device as dev
from megarl.distributed import parallel
from megarl.models.lora import adapters_disabled
from megarl.models.offload import resident
from megarl.models.sampling_cut import Cut
from megarl.ppo import actor as actor_ops
from megarl.ppo import critic as critic_ops
from megarl.ppo import nonfinite, reports
from megarl.ppo.advantages import overlong_penalty
from megarl.ppo.aggregate import global_normalizer
from megarl.ppo.batch import Batch, stitch_old_logprobs
from megarl.ppo.correction import behaviour_weights, masked_frac_by_age, mismatch_stats
from megarl.ppo.grad_align import GradAlign
from megarl.ppo.losses import LOG_RATIO_CLAMP, kl_penalty, masked_mean
from megarl.ppo.microbatch import Usage, batching_of, plan_batch
from megarl.ppo.moe_metrics import RouterStats
from megarl.ppo.nonfinite import NonFiniteError, first_nonfinite
from megarl.ppo.replay_step import StepReplay, share_routes
from megarl.ppo.schedule import forward_all
from megarl.ppo.stabilizers import bapo_bounds, m2po_keep


@dataclass(frozen=True)
class Pass:
    """One forward-only pass of a step: `fn(model, rows, micro_batches) -> [b, R]` on this
    rank's rows (schedule.forward_all plans them), with `resident` brought back from offload
    around it. `versioned`: its values
    change with the trained weights (actor, critic), not those of frozen models (reference,
    reward model). The same object serves the step and the intra-step overlap (ppo/overlap.py),
    so both compute a row the same way."""
    name: str
    model: object
    fn: Callable
    resident: object = None
    versioned: bool = True

    def run(self, batch: Batch, layout) -> torch.Tensor:
        """[B, R] over the whole batch: this DP rank's rows of the plan of `layout` (a
        microbatch.Batching or a micro-batch size), gathered over DP."""
        with resident(self.resident):
            return forward_all(self.fn, self.model, batch, layout)


def forward_passes(cfg: RootConfig, actor, reference, critic) -> dict[str, Pass]:
    """The step's forward-only passes by name: `logp` (old logprobs, current weights), `ref`
    when a reference is given (algo.uses_reference: its own model, or with LoRA the actor's
    model, run with its adapters off) and, when algo.name needs a
    critic, `values`."""
    vocab = actor.info.vocab_size
    temp = cfg.rollout.sampling.temperature   # the engine sampled from softmax(z / T): so must every logprob here
    # ... over its top-k / top-p set; the reference's too: its KL is against the reference
    # model sampled the same way (0 while the actor is the reference)
    cut = Cut.of(cfg.rollout.sampling)

    def logprobs(m, b, s):
        return actor_ops.logprobs(m, b, s, vocab, temp, cut)
    out = {"logp": Pass("logp", actor.model, logprobs)}
    if reference is not None and reference is actor.model:
        # LoRA (models/setup.py): the reference policy is the actor's frozen base, its adapters off
        def base_logprobs(m, b, s):
            with adapters_disabled(m):
                return logprobs(m, b, s)
        out["ref"] = Pass("ref", reference, base_logprobs, versioned=False)
    elif reference is not None:
        out["ref"] = Pass("ref", reference, logprobs, resident=reference, versioned=False)
    if ADVANTAGES.get(cfg.algo.name).needs_critic:
        out["values"] = Pass("values", critic.model, critic_ops.values, resident=critic.model)
    return out


def ppo_step(cfg: RootConfig, actor, reference, critic, batch: Batch, step: int,
             forward: Callable[[Pass], torch.Tensor] | None = None) -> dict:
    """`forward(pass) -> [B, R]`: how the forward-only passes are computed (default: over the
    whole batch, split over DP; with rollout.overlap, `overlap.StepForward`: the rows computed
    during the round, the rest group by group)."""
    algo, batching = cfg.algo, batching_of(cfg)
    batch, shaping = shaped(cfg, batch)   # reward.overlong_*, algo.mask_truncated
    temp, mask = cfg.rollout.sampling.temperature, batch.resp_mask
    plan = plan_batch(batch, batching, parallel.dp_size())   # one for all the forward-only passes
    replay = StepReplay(algo.routing_replay, actor.model, batch)   # MoE routing replay (ppo/replay_step.py)
    forward = forward or (lambda p: p.run(replay.batch, plan))
    passes = forward_passes(cfg, actor, reference, critic)
    old_logp = replay.old_pass(lambda: forward(passes["logp"]), plan)
    ref_logp = forward(passes["ref"]) if "ref" in passes else None   # None: no KL term, a KL of 0 changes nothing
    kl = kl_penalty(old_logp, ref_logp, algo.kl_kind) * mask if ref_logp is not None else torch.zeros_like(mask)
    estimator = ADVANTAGES.get(algo.name)
    old_values = forward(passes["values"]) if "values" in passes else None
    advantages, returns = estimator.fn(batch.scores, kl, mask, old_values, algo, cfg.rollout.sampling.n)
    # partial rollout: tokens of earlier versions keep the l_old stored when they were generated
    # (stitching); the KL above used the current weights' logprobs, as it should
    cur_logp, old_logp = old_logp, stitch_old_logprobs(old_logp, batch)
    is_w, is_stats = behaviour_weights(old_logp, batch.behav_logp, mask, algo.is_mode, algo.is_level,
                                       algo.is_cap, algo.is_low, algo.is_high)
    # NaN/Inf anywhere the update reads: stop or skip before any optimizer step (collective)
    inputs = {"rewards (scores)": batch.scores, "behaviour logprobs": batch.behav_logp,
              "old logprobs": old_logp, "advantages": advantages,
              **({"reference logprobs": ref_logp} if ref_logp is not None else {})}
    inputs.update({"values": old_values, "returns": returns} if old_values is not None else {})
    bad = first_nonfinite(inputs, mask)
    if bad:
        return nonfinite.report(bad, step, cfg.train.on_nonfinite)

    sums: dict[str, float] = {}
    stabilized: dict[str, list] = {}    # per mini-batch statistics of algo.m2po_tau / algo.bapo
    if algo.grad_align != "off" and actor.align is None:   # kept across steps: it holds the last gradient
        actor.align = GradAlign(algo.grad_align_threshold, project=algo.grad_align == "project")
    align = actor.align if algo.grad_align != "off" else None
    n_mini = mini_batch_count(cfg.train.mini_batches, cfg.samples_per_step, batch.size)
    pace_schedules(cfg.train.mini_batches / n_mini, actor, critic)
    train_actor = not estimator.needs_critic or step >= cfg.train.critic_warmup_steps
    # the shuffle is drawn on the host, so a run on CPU and on GPU visit rows in the same order
    gen = torch.Generator().manual_seed(minibatch_seed(cfg.run.seed, step))
    usage = Usage()   # what the update passes compute (metrics train_*)
    routers = RouterStats.of(actor)   # an MoE actor's router losses and expert loads (metrics moe_*)
    try:
        for _ in range(cfg.train.ppo_epochs):
            for chunk in torch.randperm(batch.size, generator=gen).chunk(n_mini):
                mini, local, rows, at, micro = dp_share(replay.train_batch, chunk.tolist(), batching, usage)
                norm = global_normalizer(mini.resp_mask, algo.loss_agg, cfg.rollout.sampling.max_new_tokens)
                if train_actor and norm:   # norm 0: every row masked out (algo.mask_truncated)
                    keep, clip, stats = stabilize(algo, chunk, cur_logp, old_logp, batch.behav_logp, advantages,
                                                  is_w, mask)
                    for k, v in stats.items():
                        stabilized.setdefault(k, []).append(v)
                    report = actor_ops.update(actor, local, old_logp[rows],
                                              None if ref_logp is None else ref_logp[rows], advantages[rows],
                                              is_w[rows], algo, micro, norm, temp, cut=Cut.of(cfg.rollout.sampling),
                                              keep=None if keep is None else keep[at], clip=clip, align=align)
                    reports.add(sums, report, "actor")
                if critic is not None and norm:
                    with resident(critic.model):
                        report = critic_ops.update(critic, local, old_values[rows], returns[rows], algo, micro, norm)
                        reports.add(sums, report, "critic")
    except NonFiniteError as err:   # a loss or gradient: the remaining updates of the step are dropped
        return nonfinite.report(str(err), step, cfg.train.on_nonfinite)
    own = parallel.is_last_stage() and parallel.tp_rank() == 0   # one copy of the reports per DP rank
    totals = reports.sum_over_ranks(sums, batch.device, own)
    on_device = {
        "advantage_mean": masked_mean(advantages, mask), **shaping,
        **is_stats, **mismatch_stats(old_logp, batch.behav_logp, mask),
        **masked_frac_by_age(is_w, mask, batch.versions, step),   # drift vs mismatch (docs/partial_rollout.md)
    }
    if ref_logp is not None:
        on_device["kl"] = kl_metric(algo.kl_kind, kl, cur_logp, ref_logp, mask)
    if old_values is not None:
        on_device["value_mean"] = masked_mean(old_values, mask)
    on_device.update({k: torch.stack([torch.as_tensor(x, dtype=torch.float32) for x in v]).mean()
                      for k, v in stabilized.items()})
    return {**reports.to_metrics(totals, cfg.train.ppo_epochs * n_mini, parallel.dp_size()), **usage.metrics(),
            **(align.take() if align else {}), **routers.collect(), **replay.metrics(), **dev.host_values(on_device)}


def shaped(cfg: RootConfig, batch: Batch) -> tuple[Batch, dict]:
    """The batch the step trains on (docs/algorithms.md) and its metrics. reward.overlong_buffer:
    each score plus DAPO's overlong penalty of its response's length (`overlong_penalty`), here
    so that every rollout mode's samples get it (the reward model's score included; the rollout's
    reward metrics stay the verifier's): overlong_penalty_mean. algo.mask_truncated: the rows
    that did not end on EOS or a stop string (finish reason length) leave the mask, so they add
    nothing to any loss term or normaliser, as if filtered out, while their scores still count in
    their group's baseline: truncated_masked_frac (of the rows)."""
    stats, r = {}, cfg.reward
    if r.overlong_buffer:
        penalty = overlong_penalty(batch.response_lens, cfg.rollout.sampling.max_new_tokens, r.overlong_buffer,
                                   r.overlong_penalty)
        batch = replace(batch, scores=batch.scores + penalty)
        stats["overlong_penalty_mean"] = penalty.mean()
    if cfg.algo.mask_truncated:
        kept = batch.stopped.to(batch.resp_mask.dtype)
        batch = replace(batch, resp_mask=batch.resp_mask * kept[:, None])
        stats["truncated_masked_frac"] = 1.0 - kept.mean()
    return batch, stats


def kl_metric(kind: str, kl, cur_logp, ref_logp, mask):
    """The k1 estimate of KL(current weights || reference) whatever algo.kl_kind shapes the
    penalty with (`kl`, that penalty): from the logprobs of the current weights, as the penalty
    itself, never the stitched l_old (carried tokens keep older versions' values there)."""
    return masked_mean(kl if kind == "k1" else kl_penalty(cur_logp, ref_logp, "k1") * mask, mask)


def pace_schedules(increment: float, *trainables) -> None:
    """A step of k times the groups makes k times the updates: each moves the LR schedule 1/k
    of a fixed step's update, so the schedule counts weight versions (models/builders.py
    Trainable.schedule_increment)."""
    for trainable in trainables:
        if trainable is not None:
            trainable.schedule_increment = increment


def mini_batch_count(mini_batches: int, samples_per_step: int, rows: int) -> int:
    """Optimizer updates per epoch for a step of `rows` samples: train.mini_batches for a step
    of samples_per_step; a step of k times as many (partial rollout's elastic steps,
    rollout.partial.max_step_multiple) makes k times as many updates, each of the same size, so
    the optimizer sees the mini-batch, and the learning rate per sample, of a fixed step."""
    per = samples_per_step // mini_batches
    if rows > samples_per_step and rows % per == 0:
        return rows // per
    return mini_batches


def dp_share(batch: Batch, chunk: list[int], batching, usage: Usage) -> tuple:
    """A mini-batch (rows `chunk` of `batch`, on the host: the plan reads their lengths there)
    and this DP rank's share of it: (the mini-batch, this rank's rows of it as a Batch, their
    indices in `batch` and positions in `chunk` as device tensors, fillers included, and its
    micro-batches over them). Every rank gets as many micro-batches; the plan is added to
    `usage`."""
    mini = batch.select(chunk)
    plan = plan_batch(mini, batching, parallel.dp_size())
    positions, micro, _ = plan.local(parallel.dp_rank())
    usage.add(plan)
    rows = [chunk[p] for p in positions]
    rows_t, at = (dev.put(torch.tensor(ix, dtype=torch.long), batch.device) for ix in (rows, positions))
    return mini, batch.select(rows_t), rows_t, at, micro


def stabilize(algo, chunk, cur_logp, old_logp, behav_logp, advantages, is_w, mask):
    """The stale-data stabilizers of one mini-batch (docs/stabilizers.md): (the token keep mask
    of its rows, laid out as `chunk`, or None; the (clip_low, clip_high) the loss uses;
    statistics).

    Computed from the whole mini-batch (`chunk`, every rank holds every row), so every rank
    and every layout derives the same mask and bounds, and from the logprobs of the weights
    the step started with (`cur_logp`: no extra forward pass per mini-batch; the paper's
    pi_theta for the step's first update, the step's own updates apart for later ones).
    - algo.m2po_tau: tokens masked by the squared log ratio of the current policy to the
      behaviour policy (staleness and train/inference mismatch, as the paper's r); the ratio
      clip is off (the paper trains M * r * A without one), so clip = (inf, inf).
    - algo.bapo: bounds on the loss's own ratio pi / l_old (l_old is the version that
      generated each token: staleness shows there), weighted by the IS weights the loss uses.
    """
    if algo.m2po_tau is None and not algo.bapo:   # neither: nothing to copy or gather per mini-batch
        return None, (algo.clip_low, algo.clip_high), {}
    chunk = dev.put(chunk, mask.device)   # the rows, drawn on the host
    mask = mask[chunk]    # only the mini-batch's rows are computed on (this runs per mini-batch)
    if algo.m2po_tau is not None:
        log_r = torch.where(mask.bool(), cur_logp[chunk] - behav_logp[chunk], 0.0)
        keep, stats = m2po_keep(log_r, mask, algo.m2po_tau)
        return keep, (float("inf"), float("inf")), stats
    if algo.bapo:
        log_r = torch.where(mask.bool(), cur_logp[chunk] - old_logp[chunk], 0.0)
        ratio = torch.exp(torch.clamp(log_r, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        c_low, c_high, stats = bapo_bounds(ratio, advantages[chunk], mask, is_w[chunk],
                                           algo.bapo_rho, tuple(algo.bapo_low), tuple(algo.bapo_high),
                                           tuple(algo.bapo_steps))
        return None, (1.0 - c_low, c_high - 1.0), stats
    return None, (algo.clip_low, algo.clip_high), {}


def trainer_logprobs(cfg: RootConfig, actor, samples: list | None, pad_id: int) -> list[list[float]]:
    """l_old of the carry: per sample, the actor's logprob of each response token at the
    rollout temperature (forward only). Collective over all trainer ranks.

    Only global rank 0 (the driver, which holds the carry) needs to pass `samples`; the
    other ranks pass None. The samples go out as three tensors (one broadcast each, not a
    pickled list), each DP rank computes its share of the rows in the micro-batches of the
    step's batching rule (ppo/microbatch.py: balanced by tokens, each micro-batch padded to
    its own longest), and the shares are gathered back: every rank returns the values of
    every sample, in order ([] when there is none).
    """
    tokens, lens, width = _share_carry(samples if _global_rank() == 0 else None, pad_id,
                                       cfg.parallel.tp if cfg.parallel.sequence_parallel else 1)
    count = lens.shape[0]
    if count == 0:
        return []
    vocab, temp, cut = actor.info.vocab_size, cfg.rollout.sampling.temperature, Cut.of(cfg.rollout.sampling)
    batch = _logprob_batch(tokens, lens, width)
    if cfg.algo.routing_replay == "r3":   # l_old of the engine's experts, as the step's (ppo/replay_step.py)
        batch.routes = share_routes(samples if _global_rank() == 0 else None, tokens.shape, tokens.device)
    resp = [r for _, r in batch.lengths()]   # one device-to-host copy, which the plan reuses
    logp = forward_all(lambda m, b, layout: actor_ops.logprobs(m, b, layout, vocab, temp, cut), actor.model,
                       batch, batching_of(cfg)).cpu()
    return [logp[i, :n].tolist() for i, n in enumerate(resp)]


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _share_carry(samples: list | None, pad_id: int, multiple: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Global rank 0's samples on every rank as tensors on the trainer's device: tokens [B, L]
    (prompt + response, right-padded, L a multiple of `multiple`), lens [B, 2] (prompt and
    response length of each row), and the longest response. Three broadcasts: the shapes,
    then the two tensors."""
    device = dev.current()
    head = torch.zeros(3, dtype=torch.long)
    if samples:
        longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        head = torch.tensor([len(samples), -(-longest // multiple) * multiple,
                             max(len(s.response_ids) for s in samples)])
    head = dev.put(head, device)
    if _world() > 1:
        dist.broadcast(head, src=0)
    count, length, width = head.cpu().tolist()
    if samples is not None:
        tokens = torch.full((count, length), pad_id, dtype=torch.long)
        lens = torch.zeros((count, 2), dtype=torch.long)
        for i, s in enumerate(samples):
            ids = s.prompt_ids + s.response_ids
            tokens[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            lens[i] = torch.tensor([len(s.prompt_ids), len(s.response_ids)])
        tokens, lens = dev.put(tokens, device), dev.put(lens, device)
    else:
        tokens = torch.empty((count, length), dtype=torch.long, device=device)
        lens = torch.empty((count, 2), dtype=torch.long, device=device)
    if _world() > 1 and count:
        dist.broadcast(tokens, src=0)
        dist.broadcast(lens, src=0)
    return tokens, lens, width


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _logprob_batch(tokens: torch.Tensor, lens: torch.Tensor, width: int) -> Batch:
    """The Batch fields a forward-only logprob pass reads (tokens, resp_index, resp_mask), laid
    out as build_batch does (width: the longest response); the other fields are zeros."""
    count, length = tokens.shape
    width = max(width, 1)
    cols = torch.arange(width, device=tokens.device)
    resp_index = (lens[:, :1] - 1 + cols).clamp(max=length - 1)
    mask = (cols < lens[:, 1:]).float()
    zeros = torch.zeros_like(mask)
    return Batch(tokens, resp_index, mask, zeros, torch.zeros_like(resp_index), zeros[:, 0],
                 torch.zeros(count, dtype=torch.bool, device=tokens.device), zeros,
                 torch.zeros_like(mask, dtype=torch.bool), lens.sum(dim=1))
