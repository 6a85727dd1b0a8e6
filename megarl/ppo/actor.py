"""The actor's (and reference's) trainer-side work: logprobs and the policy update (algo.policy_loss)."""
from __future__ import annotations

import torch

from megarl.config.registry import POLICY_LOSSES
from megarl.config.schema import AlgoConfig
from megarl.models.builders import Trainable
from megarl.models.logprobs import vocab_parallel_logprobs
from megarl.models.sampling_cut import NO_CUT, Cut
from megarl.ppo.aggregate import aggregate
from megarl.ppo.batch import Batch, response_targets, to_response_layout
from megarl.ppo.losses import kl_penalty, masked_sum
from megarl.ppo.optim import optimizer_step
from megarl.ppo.reports import token_sums
from megarl.ppo.schedule import forward_per_token, local_micro_batches, loss_scale, run_microbatches, sum_reports


def _response_logprobs(mb_batch: Batch, logits: torch.Tensor, true_vocab: int, with_entropy: bool,
                       temperature: float, cut: Cut = NO_CUT, report: dict | None = None):
    logits = to_response_layout(logits, mb_batch.resp_index)      # [b, R, V_local]
    return vocab_parallel_logprobs(logits, response_targets(mb_batch), true_vocab, with_entropy,
                                   temperature, cut, report)


def logprobs(model, batch: Batch, layout, true_vocab: int, temperature: float = 1.0,
             cut: Cut = NO_CUT) -> torch.Tensor:
    """[b, R] logprobs of the response tokens under softmax(`model` logits / temperature),
    renormalised over the engine's top-k / top-p set when `cut` (rollout.sampling) has one.
    `layout`: the micro-batches (schedule.local_micro_batches: a Batching, a size, or a list)."""
    def fn(mb, logits):
        return _response_logprobs(mb["batch"], logits, true_vocab, False, temperature, cut)[0] * mb["batch"].resp_mask
    return forward_per_token(model, batch, layout, fn)


def update(actor: Trainable, batch: Batch, old_logp, ref_logp, advantages, is_weights,
           algo: AlgoConfig, layout, normalizer: float, temperature: float = 1.0,
           keep=None, clip: tuple[float, float] | None = None, align=None, cut: Cut = NO_CUT) -> dict:
    """One optimizer step of the actor on this rank's rows of a mini-batch.

    layout: this rank's micro-batches (schedule.local_micro_batches: the step passes the
    Plan's share of this rank, every DP rank with as many).
    temperature: the rollout's sampling temperature (logits are divided by it, as the engine did);
    cut: its top-k / top-p (the logprobs renormalised over the kept set, as the engine's are).
    keep: [b, R] tokens the policy loss trains (M2PO's mask; None: all); the entropy and KL
    terms still see every token. clip: (clip_low, clip_high) for this update (BAPO's bounds,
    M2PO's none; default algo's). align: the gradient-alignment control (ppo/grad_align.py).
    normalizer: the loss aggregation's global normaliser for the whole mini-batch (all DP
    ranks), so the update does not depend on how rows are split.
    Returns this rank's summed statistics (policy loss contribution, token sums of every
    statistic policy_loss reports, entropy and KL sums, the gradient norm) for the step to
    reduce over DP (megarl.ppo.reports says how each key reduces).
    """
    extras = {"old_logp": old_logp, "adv": advantages, "is_w": is_weights}
    if ref_logp is not None:   # None: no reference model (algo.kl_coef=0), no KL term
        extras["ref_logp"] = ref_logp
    if keep is not None:
        extras["keep"] = keep
    clip_low, clip_high = clip or (algo.clip_low, algo.clip_high)
    # M2PO trains without any ratio clip (its mask bounds the update instead)
    dual_clip = None if clip_low == float("inf") else algo.dual_clip
    policy_loss = POLICY_LOSSES.get(algo.policy_loss)   # ppo | gspo | cispo | an import path (ppo/losses.py)
    micro = local_micro_batches(batch, layout)
    scale = loss_scale(len(micro))
    true_vocab = actor.info.vocab_size

    def loss_fn(mb, logits):
        b = mb["batch"]
        mask = b.resp_mask
        outside: dict = {}
        logp, entropy = _response_logprobs(b, logits, true_vocab, True, temperature, cut, outside)
        pg_mask = mask * mb["keep"] if "keep" in mb else mask
        per_token, stats = policy_loss(logp, mb["old_logp"], mb["adv"], pg_mask, clip_low,
                                       clip_high, dual_clip, mb["is_w"])
        # the normaliser counts every response token: a masked token adds 0 (M2PO's M * r * A)
        pg = aggregate(per_token, mask, algo.loss_agg, normalizer)
        total = pg - algo.entropy_coef * aggregate(entropy, mask, algo.loss_agg, normalizer)
        tokens = mask.sum()
        report = {"policy_loss": pg.detach(), "tokens": tokens, **token_sums(stats, tokens),
                  "entropy_sum": masked_sum(entropy.detach(), mask)}
        if "cut_outside" in outside:   # sampled tokens the trainer's cut left out (models/logprobs.py)
            report["cut_outside_sum"] = masked_sum(outside["cut_outside"].float(), mask)
        if "ref_logp" in mb:
            kl = kl_penalty(logp, mb["ref_logp"], algo.kl_kind)
            if algo.kl_mode == "loss" and algo.kl_coef:
                total = total + algo.kl_coef * aggregate(kl, mask, algo.loss_agg, normalizer)
            # the algo.kl_kind penalty under the weights being updated (metric kl_penalty)
            report["kl_penalty_sum"] = masked_sum(kl.detach(), mask)
        return total * scale, report

    actor.model.zero_grad_buffer()
    actor.optimizer.zero_grad()
    reports = run_microbatches(actor.model, batch, micro, loss_fn, forward_only=False,
                               extras=extras)
    grad_norm, _ = optimizer_step(actor, "actor", align)   # align keeps its own record (take())
    return {**sum_reports(reports), "grad_norm": grad_norm}
