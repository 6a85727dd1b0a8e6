"""Settings that a choice elsewhere in the config leaves unused: refused, one line each.

A value that differs from its default (`checks.changed`) and that the run would never read is
a mistake in the recipe or on the command line (a critic learning rate under GRPO, a staging
folder for a transfer that stages nothing). `CHOICES` says, for each setting that picks a
component, which settings each of its values leaves unused and why; `check_unused` refuses the
first such setting that was changed, naming it, the choice and the fix. A setting a choice
leaves unused to the run's own components may still be read by a component the config turns on
beside them (`READERS`: the held-out evaluation runs verifiers of its own, within
reward.timeout_s, whoever scores the training samples); it is then not unused
(tests/unit/test_unused_settings.py checks the table against the code that reads each setting).
The config loader reads the same table (`unused_settings`), on the layers merged: a setting an
earlier layer set than the one that made the choice leaving it unused (the recipe's
train.critic_lr under the command line's `algo.name=grpo`) is dropped, as a later layer replaces a
key; one layer that sets both is refused here.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Callable, Iterator

from megarl.config.registry import ADVANTAGES
from megarl.config.schema.agents import ServiceConfig
from megarl.config.schema.checks import changed, plain, require
from megarl.config.secrets import shown

_CRITIC = {"algo.value_clip", "algo.value_coef", "train.critic_lr", "train.critic_warmup_steps"}
# the settings each built-in algo.name reads and the others do not (one registered elsewhere:
# only the critic's settings are checked, by its needs_critic)
ESTIMATOR_READS = {"ppo": {"algo.gamma", "algo.lam", "algo.whiten_advantages"} | _CRITIC,
                   "grpo": {"algo.grpo_std_normalize"}, "rloo": set(), "reinforce_plus_plus_baseline": set(),
                   "reinforce_plus_plus": {"algo.gamma"}}
_ESTIMATOR_WHY = {"ppo": "PPO's advantages are GAE's, not group-normalised", "grpo": "GRPO has no critic and no GAE",
                  "rloo": "RLOO's baseline is the group's other samples: no critic, no GAE, no std",
                  "reinforce_plus_plus_baseline": "REINFORCE++-baseline whitens over the batch: no critic, no GAE",
                  "reinforce_plus_plus": "REINFORCE++ whitens discounted returns over the batch: no critic, no GAE"}
# the settings each built-in algo.policy_loss leaves unused (docs/algorithms.md)
_POLICY_LOSS_SKIPS = {"gspo": ({"algo.dual_clip"}, "GSPO clips the sequence ratio; the dual clip is PPO's token cap"),
                      "cispo": ({"algo.clip_low", "algo.dual_clip"},
                                "CISPO's weight has no lower bound (the paper's); the dual clip is PPO's token cap")}
# the settings each built-in algo.is_mode reads
IS_MODE_READS = {"tis": {"algo.is_cap"}, "mask": {"algo.is_low", "algo.is_high"}, "none": set()}
_PARTIAL = {"rollout.partial.concurrency", "rollout.partial.max_staleness", "rollout.partial.stale_policy"}
_SERVICE = {f"service.{f.name}" for f in fields(ServiceConfig)}
# an environment or an outside agent gives the reward
_REWARD = {"reward.fn", "reward.timeout_s", "reward.concurrency", "reward.batch_size"}


def _algo_name(value) -> tuple[set[str], str]:
    if value in ESTIMATOR_READS:
        others = set().union(*(r for n, r in ESTIMATOR_READS.items() if n != value))
        return others - ESTIMATOR_READS[value], _ESTIMATOR_WHY[value]
    if value in ADVANTAGES and not ADVANTAGES.get(value).needs_critic:
        return set(_CRITIC), "it trains no critic"
    return set(), ""


def _is_mode(value) -> tuple[set[str], str]:
    if value not in IS_MODE_READS:
        return set(), ""
    every = set().union(*IS_MODE_READS.values())
    return every - IS_MODE_READS[value], "tis reads is_cap; mask reads is_low and is_high; none neither"


def _rollout_mode(value) -> tuple[set[str], str]:
    if value == "sync":
        return _PARTIAL | {"rollout.update_mode"} | _SERVICE, (
            "a sync round waits for every sample: no concurrency cap, no staleness, no request in flight "
            "at an update; the service.* settings apply only to rollout.mode=service")
    if value == "service":
        return {"rollout.partial.concurrency"} | _REWARD, ("outside agents set the concurrency "
                                                           "(service.max_episodes) and the episode's reward")
    return set(_SERVICE), "the service.* settings apply only to rollout.mode=service"


def _transport(value) -> tuple[set[str], str]:
    if value == "collective":
        return {"weight_sync.staging_dir"}, "nothing is staged on disk"
    return ({"weight_sync.backend", "weight_sync.master_addr", "weight_sync.master_port", "weight_sync.num_buffers"},
            "the engines read staged files; there is no weight group")


# choice key -> (its value -> (the dotted keys that value leaves unused, why))
CHOICES: dict[str, Callable] = {
    "algo.name": _algo_name,
    "algo.kl_coef": lambda v: ({"algo.kl_mode", "algo.kl_kind"}, "no KL term, so no reference model")
    if not v else (set(), ""),
    "algo.is_mode": _is_mode,
    "algo.policy_loss": lambda v: _POLICY_LOSS_SKIPS.get(v, (set(), "")),
    "algo.grad_align": lambda v: ({"algo.grad_align_threshold"}, "only project removes the aligned component")
    if v != "project" else (set(), ""),
    "algo.bapo": lambda v: ({"algo.bapo_rho", "algo.bapo_low", "algo.bapo_high", "algo.bapo_steps"},
                            "no adaptive clip bounds") if not v else (set(), ""),
    "train.lr_decay_style": lambda v: ({"train.min_lr_ratio"}, "a constant learning rate has no floor")
    if v == "constant" else (set(), ""),
    "rollout.mode": _rollout_mode,
    "env.name": lambda v: (set(_REWARD), "the episode's reward comes from the environment") if v else (set(), ""),
    "weight_sync.transport": _transport,
    "rollout.engines.mode": lambda v: ({"rollout.engines.expert_parallel", "rollout.engines.gpus"},
                                       "remote servers run where and with the flags they were started with: "
                                       "give them vLLM's --enable-expert-parallel, their GPUs by their own "
                                       "CUDA_VISIBLE_DEVICES")
    if v == "remote" else (set(), ""),
    "reward.fn": lambda v: ({"reward.timeout_s", "reward.concurrency", "reward.batch_size"}, "no verifier runs")
    if v == "none" else (set(), ""),
    "rollout.group_filter": lambda v: ({"rollout.group_filter_max_draws"}, "no group is dropped, so no step "
                                       "draws more prompts than it trains") if v == "none" else (set(), ""),
    "reward.overlong_buffer": lambda v: ({"reward.overlong_penalty"}, "no overlong punishment")
    if not v else (set(), ""),
}


def _evaluation_reads(cfg) -> set[str]:
    """What the held-out evaluation (megarl/eval/, on while eval.datasets is set) reads of the
    settings CHOICES may call unused: its verifiers' time limit, concurrency and batch size, and
    reward.fn, the verifier of every dataset when eval.verifiers is empty."""
    e = cfg.eval
    if not e.datasets:
        return set()
    return {"reward.timeout_s", "reward.concurrency", "reward.batch_size"} | (set() if e.verifiers else {"reward.fn"})


# the components a config turns on beside the run's own, each: cfg -> the settings it reads
READERS: tuple[Callable, ...] = (_evaluation_reads,)


def unused_settings(cfg) -> Iterator[tuple[str, object, set[str], str]]:
    """(choice, its value, the dotted keys it leaves unused, why) for each choice of `cfg` (a
    RootConfig, or the loader's merged DictConfig), less what a component of READERS reads."""
    read = set().union(*(reads(cfg) for reads in READERS))
    for choice, rule in CHOICES.items():
        obj, name = _section(cfg, choice)
        value = getattr(obj, name)
        keys, why = rule(value)
        yield choice, value, keys - read, why


def _section(cfg, dotted: str):
    *path, name = dotted.split(".")
    obj = cfg
    for part in path:
        obj = getattr(obj, part)
    return obj, name


def check_unused(cfg) -> None:
    """ConfigError for the first changed setting of `cfg` (a RootConfig) that a choice leaves unused."""
    for choice, value, keys, why in unused_settings(cfg):
        for key in sorted(keys):
            section, field_name = _section(cfg, key)
            require(not changed(section, {field_name}), key, shown(key, plain(getattr(section, field_name))),
                    f"is not used with {choice}={value} ({why}): remove it, or change {choice}")
    _offload(cfg)


def _offload(cfg) -> None:
    """train.offload_idle moves the idle frozen or critic models to host memory: with none built it does nothing."""
    # with LoRA the reference is the actor itself, adapters off (docs/lora.md): not an idle model
    reference = cfg.algo.uses_reference and not cfg.model.lora.rank
    idle = reference or bool(cfg.reward.model_path) or (
        cfg.algo.name in ADVANTAGES and ADVANTAGES.get(cfg.algo.name).needs_critic)
    require(idle or not cfg.train.offload_idle, "train.offload_idle", cfg.train.offload_idle,
            "moves idle models (reference, critic, reward model) to host memory, and this run builds none "
            "(no reference model: algo.kl_coef=0 or model.lora.rank > 0; no critic, no reward.model_path): remove it")
