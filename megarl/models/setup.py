"""Build every model a run needs from the recipe: actor (+optimizer), reference, critic."""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoTokenizer

from megarl.config import ConfigError
from megarl.config.registry import ADVANTAGES
from megarl.config.schema import RootConfig
from megarl.data.builders import how_to_build
from megarl.distributed import parallel
from megarl.formats.mapping import mapping_for
from megarl.models import loading, offload
from megarl.models.arch import check_arch_matches
from megarl.models.builders import Trainable, build_model, local_layers, make_trainable, use_te
from megarl.models.loading import check_megatron_dir
from megarl.models.lora import apply_lora
from megarl.models.moe_layout import check_moe_layout
from megarl.models.reward import build_reward_model
from megarl.models.transformer_config import transformer_config


@dataclass
class Models:
    actor: Trainable
    # None: algo.kl_coef=0, nothing reads its logprobs. With LoRA (model.lora.rank > 0) the actor's
    # own model (`actor.model`): the reference is its base, run with the adapters off (ppo/step.py)
    reference: torch.nn.Module | None
    critic: Trainable | None
    tokenizer: object
    reward_model: torch.nn.Module | None = None


def check_model_dir(path: str, setting: str) -> None:
    """A HF model folder: config.json and *.safetensors (before anything is built or written)."""
    if not os.path.isdir(path):
        raise ConfigError(f"{setting}={path!r} does not exist: {how_to_build(path)}, or point {setting} "
                          f"at a HF folder")
    missing = [n for n in ("config.json",) if not os.path.isfile(os.path.join(path, n))]
    if not glob.glob(os.path.join(path, "*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ConfigError(f"{setting}={path!r} is not a HF model folder (no {', '.join(missing)}): "
                          f"convert a megatron checkpoint with tools/convert_megatron_to_hf.py, or fix {setting}")


def weight_source(cfg: RootConfig, hf_config):
    """(load(model, info, role), make_vocab_size_divisible_by) for this run's weights.

    HF (default): every rank reads only its shard's slices of model.path's safetensors
    (megarl.models.loading), names and shapes checked from the headers first.
    model.megatron_path: megatron loads and reshards the dist checkpoint; the vocab padding is
    the checkpoint's, so its embedding's global shape matches at any TP.
    """
    if cfg.model.megatron_path:
        path = cfg.model.megatron_path
        check_megatron_dir(path)
        divisible_by = loading.megatron_divisible_by(path, hf_config, cfg.parallel.tp)
        return (lambda model, info, role: loading.load_megatron_shard(model, path, role)), divisible_by
    mapping = mapping_for(hf_config, te_names=use_te())
    loading.open_checked(cfg.model.path, mapping).close()

    def load(model, info, role):
        loading.load_hf_shard(model, info, loading.HFCheckpoint(cfg.model.path), role, mapping)
    return load, cfg.model.make_vocab_size_divisible_by


def moe_layout(cfg: RootConfig, hf_config, role: str = "actor") -> dict:
    """transformer_config's MoE arguments from parallel.ep / moe_dispatcher, moe.* and
    algo.routing_replay (the actor's and reference's: a critic routes on its own)."""
    check_moe_layout(cfg.parallel, hf_config)   # ConfigErrors naming the settings, before megatron's own
    m = cfg.moe
    return dict(ep=cfg.parallel.ep, dispatcher=cfg.parallel.moe_dispatcher,
                router=dict(aux_loss_coeff=m.aux_coeff(hf_config), load_balancing=m.load_balancing,
                            z_loss_coeff=m.z_loss_coeff,
                            routing_replay=cfg.algo.routing_replay if role != "critic" else "off"))


def lr_schedule(cfg) -> dict:
    """make_trainable's schedule arguments, in optimizer updates (megatron's scheduler counts
    them): train.lr_warmup_steps counts steps (weight versions), each a fixed step's
    ppo_epochs x mini_batches updates."""
    t = cfg.train
    per_step = t.ppo_epochs * t.mini_batches
    return dict(warmup=t.lr_warmup_steps * per_step, total_updates=t.steps * per_step,
                decay_style=t.lr_decay_style, min_lr_ratio=t.min_lr_ratio)


def build_all(cfg: RootConfig, with_tokenizer: bool = True) -> Models:
    check_model_dir(cfg.model.path, "model.path")
    hf_config = AutoConfig.from_pretrained(cfg.model.path)
    check_arch_matches(cfg, hf_config.to_dict())   # recipe's model.arch (what `megarl plan` sized) = the checkpoint
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path) if with_tokenizer else None
    dtype = getattr(torch, cfg.model.dtype)
    lora = cfg.model.lora
    local_layers(lora.rank > 0)   # before weight_source: its mapping reads the layer names (use_te)
    on_gpu = torch.cuda.is_available()
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    load, divisible_by = weight_source(cfg, hf_config)

    def make(role):
        # each model gets its own TransformerConfig: megatron hangs per-model hooks on it
        tcfg = transformer_config(hf_config, tp, pp, dtype, on_gpu, cfg.train.recompute,
                                  cfg.parallel.sequence_parallel, **moe_layout(cfg, hf_config, role))
        model, info = build_model(hf_config, tcfg, divisible_by, role)
        load(model, info, role)
        if lora.rank and (role == "actor" or (role == "critic" and lora.critic)):
            # after the load (the base's weights are model.path's), before DDP and the optimizer:
            # megatron's DDP gives frozen parameters no grad buffer, its optimizer no state
            apply_lora(model, lora)
            if role == "critic" and parallel.is_last_stage():
                model.output_layer.weight.requires_grad = True   # the value head is new: trained in full
        return model, info

    t = cfg.train
    schedule = lr_schedule(cfg)
    actor = make_trainable(*make("actor"), t.actor_lr, t.weight_decay, t.grad_clip, **schedule)
    reference = None   # only the KL term reads its logprobs (algo.uses_reference): else neither built nor run
    if cfg.algo.uses_reference and lora.rank:
        reference = actor.model   # the actor's frozen base, adapters off: no second model (ppo/step.py)
    elif cfg.algo.uses_reference:
        reference, _ = make("reference")
        reference.eval().requires_grad_(False)
    critic = None
    if ADVANTAGES.get(cfg.algo.name).needs_critic:
        critic = make_trainable(*make("critic"), t.critic_lr, t.weight_decay, t.grad_clip, **schedule)
    reward_model = None
    if cfg.reward.model_path:
        reward_model = build_reward_model(cfg.reward.model_path, tp, pp, dtype,
                                          cfg.model.make_vocab_size_divisible_by)
    if t.offload_idle:
        separate = reference if reference is not actor.model else None   # the actor itself is never idle
        for idle in (separate, critic.model if critic else None, reward_model):
            if idle is not None:
                offload.enable(idle)
    return Models(actor, reference, critic, tokenizer, reward_model)
