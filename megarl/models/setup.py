"""Build every model a run needs from the recipe: actor (+optimizer), reference, critic."""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from megarl.config.schema import RootConfig
from megarl.models.builders import Trainable, build_model, load_hf_weights, make_trainable
from megarl.models.config import transformer_config


@dataclass
class Models:
    actor: Trainable
    reference: torch.nn.Module
    critic: Trainable | None
    tokenizer: object
    reward_model: torch.nn.Module | None = None


def read_hf_state(path: str) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint folder (every *.safetensors file)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"model.path={path!r} holds no *.safetensors files: build the tiny "
                                f"model with `python tools/make_tiny_model.py` or convert a checkpoint")
    state = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for k in sf.keys():
                state[k] = sf.get_tensor(k)
    return state


def check_model_dir(path: str, setting: str) -> None:
    """A HF model folder: config.json and *.safetensors (before anything is built or written)."""
    from megarl.config import ConfigError
    if not os.path.isdir(path):
        raise ConfigError(f"{setting}={path!r} does not exist: build the tiny model with "
                          f"`python tools/make_tiny_model.py --out {path}` or point {setting} at a HF folder")
    missing = [n for n in ("config.json",) if not os.path.isfile(os.path.join(path, n))]
    if not glob.glob(os.path.join(path, "*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ConfigError(f"{setting}={path!r} is not a HF model folder (no {', '.join(missing)}): "
                          f"convert a megatron checkpoint with tools/convert_megatron_to_hf.py, or fix {setting}")


def build_all(cfg: RootConfig, with_tokenizer: bool = True) -> Models:
    check_model_dir(cfg.model.path, "model.path")
    hf_config = AutoConfig.from_pretrained(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path) if with_tokenizer else None
    hf_state = read_hf_state(cfg.model.path)
    dtype = getattr(torch, cfg.model.dtype)
    on_gpu = torch.cuda.is_available()
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    updates = cfg.train.steps * cfg.train.ppo_epochs * cfg.train.mini_batches

    def make(role):
        # each model gets its own TransformerConfig: megatron hangs per-model hooks on it
        tcfg = transformer_config(hf_config, tp, pp, dtype, on_gpu, cfg.train.recompute,
                                  cfg.parallel.sequence_parallel)
        model, info = build_model(hf_config, tcfg,
                                  cfg.model.make_vocab_size_divisible_by, role)
        load_hf_weights(model, info, hf_state, role)
        return model, info

    t = cfg.train
    schedule = dict(warmup=t.lr_warmup_steps, total_updates=updates, decay_style=t.lr_decay_style,
                    min_lr_ratio=t.min_lr_ratio)
    actor = make_trainable(*make("actor"), t.actor_lr, t.weight_decay, t.grad_clip, **schedule)
    reference, _ = make("reference")
    reference.eval().requires_grad_(False)
    critic = None
    if cfg.algo.name == "ppo":
        critic = make_trainable(*make("critic"), t.critic_lr, t.weight_decay, t.grad_clip, **schedule)
    reward_model = None
    if cfg.reward.model_path:
        from megarl.rewards.model import build_reward_model
        reward_model = build_reward_model(cfg.reward.model_path, tp, pp, dtype,
                                          cfg.model.make_vocab_size_divisible_by)
    if t.offload_idle:
        from megarl.models import offload
        for idle in (reference, critic.model if critic else None, reward_model):
            if idle is not None:
                offload.enable(idle)
    return Models(actor, reference, critic, tokenizer, reward_model)
