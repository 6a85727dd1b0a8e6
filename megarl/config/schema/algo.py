"""The RL algorithm (losses, advantages, corrections, stabilizers) and the optimizer's schedule."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from megarl.config.registry import ADVANTAGES, IS_LEVELS, IS_MODES, KL_KINDS, LOSS_AGGS, POLICY_LOSSES
from megarl.config.schema.checks import changed, one_of, require


@dataclass
class AlgoConfig:
    # advantages (docs/algorithms.md): ppo (GAE with a critic) | grpo (group-normalised, no critic) |
    # rloo (leave-one-out baseline) | reinforce_plus_plus_baseline (group mean out, batch-whitened) |
    # reinforce_plus_plus (discounted returns of per-token rewards, batch-whitened: reads algo.gamma)
    name: str = "ppo"
    # the policy loss (docs/algorithms.md): ppo (clipped token ratio) | gspo (clipped sequence ratio,
    # the token ratios' geometric mean) | cispo (clipped, stop-gradient IS weight on log pi; no lower bound)
    policy_loss: str = "ppo"
    mask_truncated: bool = False       # samples that hit the token budget (not ended on EOS) add no loss (DAPO)
    gamma: float = 1.0                 # discount per token
    lam: float = 0.95                  # GAE lambda
    clip_low: float = 0.2              # PPO ratio clip below: r >= 1 - clip_low
    clip_high: float = 0.2             # PPO ratio clip above: r <= 1 + clip_high ("clip-higher")
    dual_clip: Optional[float] = None  # cap the loss of negative-advantage tokens at dual_clip*|A| (> 1)
    value_clip: Optional[float] = 0.2  # clip the critic's new values to old +- this; null: no clip
    value_coef: float = 1.0            # weight of the value loss (the critic has its own optimizer)
    kl_coef: float = 0.0               # weight of the KL to the reference policy
    kl_mode: str = "reward"            # reward: per-token penalty in the reward | loss: term in the actor loss
    kl_kind: str = "k1"                # estimator: k1 | k2 | k3 | abs
    entropy_coef: float = 0.0          # entropy bonus in the actor loss
    whiten_advantages: bool = True     # normalise PPO advantages over the batch's tokens
    grpo_std_normalize: bool = True    # GRPO: divide by the group's std (Dr.GRPO sets this false)
    # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (Dr. GRPO)
    loss_agg: str = "token-mean"
    is_mode: str = "tis"               # behaviour correction: tis (truncate) | mask | none
    is_level: str = "token"            # token | sequence | geo_sequence
    is_cap: float = 2.0                # TIS truncation C for w = exp(l_old - l_mu)
    is_low: float = 0.5                # mask mode: keep tokens with is_low <= w <= is_high
    is_high: float = 2.0
    # Stale-data stabilizers (docs/stabilizers.md), each off by default.
    # M2PO (Zheng et al. 2025): per mini-batch, mask the tokens with the largest squared log
    # ratio log(pi / pi_behaviour) until the rest's mean is <= this; replaces the ratio clip
    m2po_tau: Optional[float] = None
    # BAPO (Xi et al. 2025): per mini-batch clip bounds [c_low, c_high] (ratio bounds, not
    # 1 +- eps), moved from their start toward their limit until the positive-advantage tokens
    # carry at least bapo_rho of the gradient-carrying contribution; replaces clip_low/high
    bapo: bool = False
    bapo_rho: float = 0.4
    bapo_low: List[float] = field(default_factory=lambda: [0.6, 0.9])    # c_low: start, limit
    bapo_high: List[float] = field(default_factory=lambda: [1.2, 3.0])   # c_high: start, limit
    bapo_steps: List[float] = field(default_factory=lambda: [0.02, 0.05])  # c_low, c_high increments
    # gradient-alignment control (GAC, Xu et al. 2026): off | log (the cosine of consecutive
    # actor gradients as grad_cosine) | project (also shrink the component along the previous
    # gradient so the cosine is at most grad_align_threshold)
    grad_align: str = "off"
    grad_align_threshold: float = 0.3
    # Mixture-of-Experts routing replay (docs/moe.md "Routing replay"): off | r3 (the trainer's
    # routers take the experts the engine chose for each token, Sample.routes) | r2 (the experts
    # the trainer chose in the step's old-logprob pass, replayed in its policy-loss forwards)
    routing_replay: str = "off"

    def __post_init__(self):
        ADVANTAGES.check(self.name)
        POLICY_LOSSES.check(self.policy_loss)
        one_of("algo.kl_mode", self.kl_mode, {"reward", "loss"})
        one_of("algo.routing_replay", self.routing_replay, {"off", "r2", "r3"})
        KL_KINDS.check(self.kl_kind)
        LOSS_AGGS.check(self.loss_agg)
        IS_MODES.check(self.is_mode)
        IS_LEVELS.check(self.is_level)
        require(0 <= self.gamma <= 1, "algo.gamma", self.gamma, "must be in [0, 1]")
        require(0 <= self.lam <= 1, "algo.lam", self.lam, "must be in [0, 1]")
        require(self.clip_low > 0 and self.clip_high > 0, "algo.clip_low/clip_high",
                 (self.clip_low, self.clip_high), "both must be > 0")
        require(self.dual_clip is None or self.dual_clip > 1, "algo.dual_clip", self.dual_clip,
                 "must be > 1 (or null to disable)")
        require(self.is_low <= 1 <= self.is_high, "algo.is_low/is_high",
                 (self.is_low, self.is_high), "need is_low <= 1 <= is_high")
        self._check_stabilizers()
        self._check_policy_loss()

    @property
    def uses_reference(self) -> bool:
        """Whether anything reads the reference model's logprobs: only the KL term (in the
        reward or the loss), so without one the reference is neither built nor run."""
        return self.kl_coef != 0

    def _check_policy_loss(self) -> None:
        """The stabilizers that read PPO's token-level clip, refused under the other built-in losses
        (algo.dual_clip and cispo's clip_low: schema/unused.py CHOICES)."""
        if self.policy_loss not in ("gspo", "cispo"):
            return
        require(not self.bapo, "algo.bapo", self.bapo, f"adapts PPO's token clip by the tokens that keep their "
                 f"gradient, which algo.policy_loss={self.policy_loss} does not have: remove one of them")
        require(self.m2po_tau is None or self.policy_loss != "gspo", "algo.m2po_tau", self.m2po_tau,
                 "masks tokens and removes the ratio clip, and algo.policy_loss=gspo clips whole sequences: "
                 "remove one of them")

    def _check_stabilizers(self) -> None:
        require(self.m2po_tau is None or self.m2po_tau > 0, "algo.m2po_tau", self.m2po_tau,
                 "must be > 0 (the paper uses 0.04), or null to disable M2PO")
        require(self.m2po_tau is None or not self.bapo, "algo.m2po_tau/bapo", (self.m2po_tau, self.bapo),
                 "M2PO trains without a ratio clip and BAPO adapts that clip: choose one")
        require(self.m2po_tau is None or self.dual_clip is None, "algo.dual_clip", self.dual_clip,
                 "M2PO (algo.m2po_tau) replaces ratio clipping, dual clip included: remove one of them")
        one_of("algo.grad_align", self.grad_align, {"off", "log", "project"})
        require(0 <= self.grad_align_threshold < 1, "algo.grad_align_threshold", self.grad_align_threshold,
                 "must be in [0, 1) (a cosine; 0 removes the whole aligned component)")
        # the threshold and BAPO's settings unused when off: schema/unused.py CHOICES
        replaced = "M2PO (algo.m2po_tau)" if self.m2po_tau is not None else "BAPO (algo.bapo)" if self.bapo else None
        require(replaced is None or not changed(self, {"clip_low", "clip_high"}), "algo.clip_low/clip_high",
                 (self.clip_low, self.clip_high), f"{replaced} replaces the fixed ratio clip, so these would be "
                 f"ignored: remove them (BAPO's bounds are algo.bapo_low / algo.bapo_high)")
        if not self.bapo:
            return
        for key in ("bapo_low", "bapo_high", "bapo_steps"):
            value = list(getattr(self, key))
            require(len(value) == 2, f"algo.{key}", value, "must be a list of two numbers")
        (a_lo, b_lo), (a_hi, b_hi), (d_lo, d_hi) = self.bapo_low, self.bapo_high, self.bapo_steps
        require(0 < self.bapo_rho < 1, "algo.bapo_rho", self.bapo_rho, "must be in (0, 1) (the paper uses 0.4)")
        require(0 < a_lo <= b_lo < 1, "algo.bapo_low", list(self.bapo_low),
                 "needs 0 < start <= limit < 1 (ratio bounds below 1, e.g. [0.6, 0.9])")
        require(1 < a_hi <= b_hi, "algo.bapo_high", list(self.bapo_high),
                 "needs 1 < start <= limit (ratio bounds above 1, e.g. [1.2, 3.0])")
        require(d_lo > 0 and d_hi > 0, "algo.bapo_steps", list(self.bapo_steps),
                 "both increments must be > 0 (e.g. [0.02, 0.05])")


#: rows per micro-batch when micro-batches go by rows and train.micro_batch_size is unset
ROWS_PER_MICRO_BATCH = 8


@dataclass
class TrainConfig:
    steps: int = 60                    # optimizer steps of the RL loop (one rollout round each)
    groups_per_step: int = 16          # prompts per step; each has rollout.sampling.n samples
    ppo_epochs: int = 1                # passes over each step's data
    mini_batches: int = 1              # optimizer updates per epoch
    # Micro-batches (gradient accumulation; docs/design.md "Batching"): by default as many rows
    # as fit a token budget (rows x their padded length), so short rows share a micro-batch and
    # the trainer computes tokens, not padding. The budget: max_tokens_per_micro_batch > 0, or
    # -1 (the default) for BUDGET_PER_CONTEXT x rollout.engines.max_model_len (schema/root.py).
    # Setting micro_batch_size (or max_tokens_per_micro_batch=0) cuts micro-batches by rows
    # instead (ROWS_PER_MICRO_BATCH when unset). A budget excludes micro_batch_size (a budget on
    # the command line replaces a recipe's micro_batch_size: config/loader.py ALTERNATIVES).
    # Either way each micro-batch is padded only to its own longest row and DP ranks get equal tokens.
    micro_batch_size: Optional[int] = None   # rows per micro-batch; unset: by the token budget
    max_tokens_per_micro_batch: int = -1  # -1: derived (above); 0: by rows; else >= max_model_len
    # false: every row padded to the step's longest, rows in order (the layout before
    # length-aware batching, for comparisons); a token budget needs true
    remove_padding: bool = True
    actor_lr: float = 1e-4
    critic_lr: float = 5e-4
    # linear warm-up of both learning rates, in steps (weight versions; a step of groups_per_step
    # groups is ppo_epochs x mini_batches updates, a step of k times the groups moves the schedule
    # as one step: docs/partial_rollout.md)
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"   # after warm-up: constant | linear | cosine (to min_lr_ratio x lr)
    min_lr_ratio: float = 0.1          # floor of the decayed learning rate, as a fraction of the peak
    recompute: str = "none"            # activation recomputation: none | full (recompute every layer in backward)
    offload_idle: bool = False         # keep reference and critic weights in host memory except while used
    weight_decay: float = 0.0
    grad_clip: float = 1.0             # clip the global gradient norm (0: off)
    critic_warmup_steps: int = 0       # steps that train only the critic (PPO)
    # NaN/Inf in rewards, logprobs, values, losses or gradients: stop | skip (the step's update)
    on_nonfinite: str = "stop"

    def __post_init__(self):
        require(self.steps >= 1, "train.steps", self.steps, "must be >= 1")
        require(self.groups_per_step >= 1, "train.groups_per_step", self.groups_per_step, "must be >= 1")
        require(self.ppo_epochs >= 1, "train.ppo_epochs", self.ppo_epochs, "must be >= 1")
        require(self.mini_batches >= 1, "train.mini_batches", self.mini_batches, "must be >= 1")
        require(self.micro_batch_size is None or self.micro_batch_size >= 1, "train.micro_batch_size",
                self.micro_batch_size, "must be >= 1, or unset (micro-batches by the token budget)")
        self._check_token_budget()
        one_of("train.lr_decay_style", self.lr_decay_style, {"constant", "linear", "cosine"})
        one_of("train.recompute", self.recompute, {"none", "full"})
        one_of("train.on_nonfinite", self.on_nonfinite, {"stop", "skip"})
        require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        require(self.actor_lr > 0 and self.critic_lr > 0, "train.actor_lr/critic_lr",
                 (self.actor_lr, self.critic_lr), "learning rates must be > 0")


    @property
    def rows_per_micro_batch(self) -> int:
        """Rows per micro-batch where a pass cuts by rows (micro-batches by row count, the verify
        probe): micro_batch_size, or ROWS_PER_MICRO_BATCH when it is unset."""
        return self.micro_batch_size or ROWS_PER_MICRO_BATCH

    def _check_token_budget(self) -> None:
        budget = self.max_tokens_per_micro_batch
        require(budget >= -1, "train.max_tokens_per_micro_batch", budget,
                 "must be -1 (derived from rollout.engines.max_model_len), 0 (micro-batches by row count) "
                 "or a budget in tokens")
        if budget > 0:
            require(self.micro_batch_size is None, "train.micro_batch_size", self.micro_batch_size,
                     f"sizes micro-batches by rows, but train.max_tokens_per_micro_batch={budget} sizes them by "
                     f"tokens: remove train.micro_batch_size, or set train.max_tokens_per_micro_batch=0")
            require(self.remove_padding, "train.remove_padding", self.remove_padding,
                     f"false pads every row to the step's longest, which train.max_tokens_per_micro_batch={budget} "
                     f"cannot bound: set train.remove_padding=true, or train.max_tokens_per_micro_batch=0")
