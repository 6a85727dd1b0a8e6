"""Per-step speed and resource figures (docs/metrics.md, "Speed and resources"): learning
rates, tokens per second of the rollout and of the trainer, the trainer's model FLOPs
utilisation on GPUs, and peak memory (GPU and host) of the driver rank.

MFU counts the matrix FLOPs of the step's trainer passes per token from the model's active
parameters N (megarl/plan/memory.py): 2N per forward-only pass (old logprobs; reference with a KL
term; values with a critic), 6N per trained token and epoch (actor; critic), over the step's
real tokens (prompt + response), divided by the train time x the trainer's GPUs x the GPU's dense
BF16 peak. A model with LoRA adapters (model.lora) trains at 4N + 6 x its adapters per token: its
frozen base needs no weight gradients. Attention's sequence-quadratic FLOPs are left out (a
lower bound at long contexts).
"""
from __future__ import annotations

import resource
import sys

import torch

from megarl.config.registry import ADVANTAGES
from megarl.models.arch import resolve_arch
from megarl.plan import lora as plan_lora
from megarl.plan.memory import active_params

GiB = 2**30
# dense BF16 peak per GPU, FLOP/s, by a name torch.cuda.get_device_name contains (NVIDIA's
# datasheets; 2:4 sparsity figures are twice these). A GPU not listed reports no mfu.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12,
             "A800": 312e12, "L40S": 362e12, "B200": 2250e12}


def peak_flops(device_name: str) -> float | None:
    for name in sorted(PEAK_BF16, key=len, reverse=True):   # GH200 before H200
        if name in device_name:
            return PEAK_BF16[name]
    return None


def train_flops_per_token(cfg, active: int, train_actor: bool = True, adapters: int = 0) -> float:
    """Matrix FLOPs per real token of one step's trainer passes (module docstring). `adapters`:
    the LoRA adapters' parameters (model.lora): a model with a frozen base computes no weight
    gradients of the base, 4N + 6 x adapters per trained token (as the simulator prices it)."""
    epochs = cfg.train.ppo_epochs

    def update(role: str) -> float:
        return (4 * active + 6 * adapters if adapters and plan_lora.adapted(cfg, role) else 6 * active) * epochs
    flops = 2 * active + (update("actor") if train_actor else 0)         # old logprobs + actor updates
    if cfg.algo.uses_reference:
        flops += 2 * active
    if ADVANTAGES.get(cfg.algo.name).needs_critic:
        flops += 2 * active + update("critic")                           # values + critic updates
    return flops


def real_tokens(samples) -> int:
    """The step's real tokens: prompt + response of every sample (no padding)."""
    return sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)


def throughput(samples, round_metrics: dict, rollout_s: float, train_s: float, tokens: int) -> dict:
    """rollout_tokens_per_s: tokens the engines generated in the round (partial rollout: this
    round's, carried ones included) per second of the rollout; train_tokens_per_s: the step's
    real tokens (`tokens`, prompt + response) per second of the trainer's work."""
    generated = round_metrics.get("rollout_tokens") or sum(len(s.response_ids) for s in samples)
    return {"rollout_tokens_per_s": generated / max(rollout_s, 1e-9),
            "train_tokens_per_s": tokens / max(train_s, 1e-9)}


def learning_rates(models) -> dict:
    """The learning rate of each trained model's last update this step (the schedule's value)."""
    out = {"lr_actor": models.actor.optimizer.param_groups[0]["lr"]}
    if models.critic is not None:
        out["lr_critic"] = models.critic.optimizer.param_groups[0]["lr"]
    return out


def host_mem_peak_gb() -> float:
    """Peak resident memory of this process since it started (getrusage: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (GiB if sys.platform == "darwin" else 2**20)


class SpeedMeter:
    """The driver's per-step figures: `start()` at the step's start (resets the GPU's peak),
    `metrics(...)` at its end."""

    def __init__(self, cfg, world_size: int):
        self.cfg, self.world = cfg, world_size
        arch = resolve_arch(cfg)[0]                          # model.arch facts, else model.path/config.json
        self.active = active_params(arch)
        lora = plan_lora.lora_of(cfg)
        self.adapters = plan_lora.adapter_params(arch, lora.rank, lora.targets) if lora else 0
        self.cuda = torch.cuda.is_available()
        self.peak = peak_flops(torch.cuda.get_device_name()) if self.cuda else None

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def metrics(self, step: int, models, samples, round_metrics: dict, rollout_s: float, train_s: float) -> dict:
        tokens = real_tokens(samples)
        out = {**learning_rates(models), **throughput(samples, round_metrics, rollout_s, train_s, tokens),
               "host_mem_peak_gb": host_mem_peak_gb()}
        if self.cuda:
            out["gpu_mem_peak_gb"] = torch.cuda.max_memory_allocated() / GiB
            if self.peak and self.active:
                warm = ADVANTAGES.get(self.cfg.algo.name).needs_critic and step < self.cfg.train.critic_warmup_steps
                flops = tokens * train_flops_per_token(self.cfg, self.active, not warm, self.adapters)
                out["mfu"] = flops / (max(train_s, 1e-9) * self.peak * self.world)
        return out
