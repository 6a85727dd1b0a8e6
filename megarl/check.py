"""`megarl check RECIPE [overrides]`: what `megarl train` checks before its first step, then exit.

The checks are `megarl train`'s own (one home each): the recipe against the schema
(`load_config`, in the CLI), the parallel layout against the ranks the job launches
(`validate_world`), the plan against the recipe's cluster (`megarl plan`), the launch against
this machine (`preflight.check_backends`), the data rows, model and tokenizer files and the
engines' context (`Trainer.check_inputs`, the very method `train` runs), the checkpoint a rerun
would resume from, and in rollout.engines.mode=remote each engine URL answering (health, API
key, served context: the start check of the HTTP engine). Nothing is written and nothing is
started; the first problem raises ConfigError (exit 2 in the CLI) or EngineError.
"""
from __future__ import annotations

import asyncio
import os
import sys

import torch

from megarl import plan, preflight
from megarl.checkpoint import compat
from megarl.checkpoint import manager as ckpt
from megarl.config import ConfigError, RootConfig, validate_world
from megarl.distributed.env import read_env
from megarl.models.arch import check_arch_matches
from megarl.rollout.engines.build import ENGINE_KINDS
from megarl.train import Trainer


def world_size(cfg: RootConfig) -> int:
    """The trainer ranks the job launches: WORLD_SIZE under torchrun/srun, else the recipe's
    trainer nodes x GPUs per node (a login node checking a cluster recipe), else one rank."""
    if "WORLD_SIZE" in os.environ:
        return read_env().world_size
    if cfg.cluster.gpus_per_node:
        return cfg.cluster.trainer_node_count * cfg.cluster.gpus_per_node
    return 1


def machine_checks_apply(cfg: RootConfig) -> bool:
    """The launch checks (backends against this machine's GPUs) say something only on a
    machine like the job's: a GPU machine, or a CPU recipe on a CPU machine."""
    return torch.cuda.is_available() or not cfg.cluster.gpus_per_node


def check(cfg: RootConfig, say=print) -> None:
    """Every check `megarl train` makes before its first step; `say` reports each one passed."""
    world = world_size(cfg)
    dp = validate_world(cfg, world)
    say(f"layout: {world} trainer rank(s), tp={cfg.parallel.tp} pp={cfg.parallel.pp} dp={dp}")
    if cfg.cluster.gpus_per_node:
        p = plan.make_plan(cfg)
        if not p["fits"]:
            raise ConfigError(plan.problems_message(p))
        say("plan: fits the recipe's cluster (megarl plan prints it)")
    if machine_checks_apply(cfg):
        preflight.check_backends(cfg)
        say("backends: this machine can host the launch")
    else:
        say("backends: not checked (this machine shows no GPU and the recipe's cluster has GPUs): run "
            "megarl check on a trainer node for them")
    trainer = Trainer(cfg)
    trainer.is_driver = True   # one process: the driver's checks, without a process group
    trainer.check_inputs()
    say(f"data: {len(trainer.records)} rows of {cfg.data.prompts} fit rollout.engines.max_model_len="
        f"{cfg.rollout.engines.max_model_len}")
    # the facts the recipe (its defaults: model file) was planned with = model.path's config.json
    check_arch_matches(cfg, preflight.read_hf_config(cfg.model.path))
    say(f"model: {cfg.model.path} (weights, config.json, tokenizer)")
    say(f"checkpoint: {resume_line(cfg)}")
    if cfg.rollout.engines.mode == "remote":
        asyncio.run(_reach_engines(cfg))
        say(f"engines: {len(cfg.rollout.engines.urls)} remote server(s) answer with the served model")


def resume_line(cfg: RootConfig) -> str:
    """Where a rerun starts, and what changed since its checkpoint was written (a change that
    breaks the run raises, compat.check_resume)."""
    resume = ckpt.resume_point(cfg.checkpoint_dir) if cfg.checkpoint.resume else None
    if resume is None:
        return "starts from step 0"
    changed = compat.check_resume(cfg, resume)
    forced = " (checkpoint.resume=force)" if cfg.checkpoint.resume == "force" and changed else ""
    return f"resumes from {resume}" + (f"; changed since{forced}: {'; '.join(changed)}" if changed else "")


async def _reach_engines(cfg: RootConfig) -> None:
    """Each remote URL: health, API key, served context (HTTPVLLMEngine.start), then closed."""
    build = ENGINE_KINDS.get("remote")
    for i in range(len(cfg.rollout.engines.urls)):
        engine = build(cfg.rollout, cfg.model.path, cfg.run.seed, "", i, "")
        try:
            await engine.start()
        finally:
            await engine.close()


def main(cfg: RootConfig) -> int:
    check(cfg, lambda line: print(f"megarl check: {line}"))
    print("megarl check: OK: megarl train would start", file=sys.stdout)
    return 0
