"""`megarl train`: the RL loop, as a short recipe of named steps.

Rank 0 drives the rollout engine and writes metrics; every rank trains. One step: rollout ->
share samples -> PPO/GRPO update -> push weights to the engine as the next version -> log ->
maybe checkpoint.
"""
from __future__ import annotations

import os
import time

import torch
from omegaconf import OmegaConf

from megarl import preflight
from megarl.config import ConfigError, RootConfig, save_config, validate_world
from megarl.config.paths import check_writable
from megarl.distributed import cpu, device, faults, parallel
from megarl.distributed.env import from_rank0, init_distributed
from megarl.distributed.stop import StopSignal
from megarl.rollout import reaper


def train(cfg: RootConfig) -> dict:
    env = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s)
    validate_world(cfg, env.world_size)
    reaper.guard_descendants()   # engines, checkpoint writers: nothing outlives a SIGKILLed rank
    if cpu.apply_if_cpu():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.world_size))
    parallel.initialize(cfg.parallel.tp, cfg.parallel.pp, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)

    # imported after the shim: megatron reads torch.cuda state at import time
    from megarl.checkpoint import manager as ckpt
    from megarl.data.prompts import PromptSampler, check_chat_template, load_prompts
    from megarl.metrics.logger import MetricsLogger
    from megarl.models.loading import check_megatron_dir
    from megarl.models.setup import build_all, check_model_dir
    from megarl.ppo.batch import build_batch
    from megarl.ppo.step import ppo_step, trainer_logprobs
    from megarl.rewards import NEEDS_ANSWER, build_verifier
    from megarl.rewards import model as reward_model
    from megarl.rollout import weight_sync
    from megarl.rollout.dump import dump_samples
    from megarl.rollout.build import weight_backend
    from megarl.rollout.pool import open_pool
    from megarl.rollout.rounds import Rollout

    # cheap inputs first: a bad data path or reward name fails before any model is built
    d = cfg.data
    records = load_prompts(d.prompts, d.prompt_key, d.messages_key,
                           d.answer_key if cfg.reward.fn in NEEDS_ANSWER else None)
    sampler = PromptSampler(len(records), cfg.run.seed, cfg.data.shuffle)
    check_model_dir(cfg.model.path, "model.path")
    preflight.check_model_files(cfg.model.path, "model.path")   # weights complete, a tokenizer there
    hf_config = preflight.read_hf_config(cfg.model.path)
    preflight.check_engines_fit(cfg, hf_config)                 # engine TP vs the model and this machine
    if cfg.model.megatron_path:
        check_megatron_dir(cfg.model.megatron_path, "model.megatron_path")
        preflight.check_megatron_files(cfg.model.megatron_path, "model.megatron_path")
    else:   # the weights come from model.path: names and shapes against config.json (headers)
        preflight.check_weights_match(cfg.model.path, "model.path")
    tokenizer = preflight.load_tokenizer(cfg.model.path)
    preflight.ensure_pad_token(tokenizer, cfg.model.path)
    check_chat_template(records, cfg.model.path, d.prompt_key, d.messages_key, d.prompts, tokenizer)
    # every prompt encodes and fits the engine's context with its response budget (rank 0
    # tokenizes the dataset once; every rank gets the verdict)
    _agree(lambda: preflight.check_prompts(records, tokenizer, cfg, hf_config.get("vocab_size")),
           env.rank == 0)
    # errors and timeouts of a verifier score 0 and are counted (reward_errors / reward_timeouts)
    reward_fn = build_verifier(cfg.reward.fn, timeout_s=cfg.reward.timeout_s, answer_key=d.answer_key)
    if cfg.reward.model_path:
        check_model_dir(cfg.reward.model_path, "reward.model_path")
        preflight.check_model_files(cfg.reward.model_path, "reward.model_path", tokenizer=False)
    check_writable(cfg.run.dir, "run.dir")
    if cfg.checkpoint.dir:   # elsewhere than run.dir: refused now, not at the first save
        check_writable(cfg.checkpoint.dir, "checkpoint.dir")
    if cfg.weight_sync.transport == "files":
        from megarl.rollout.transfer.files import check_staging_base
        check_staging_base(cfg.weight_sync.staging_dir)
    # the newest intact checkpoint (damaged newer ones are named and skipped); all damaged: stop
    resume_from = _agree(lambda: ckpt.resume_point(cfg.checkpoint_dir) if cfg.checkpoint.resume else None,
                         env.rank == 0)
    # nothing is written before this line: a bad input above leaves no trace
    lock = _lock_run_dir(cfg.run.dir, env.rank == 0)   # a second run on this run.dir stops here
    models = build_all(cfg)
    tokenizer = models.tokenizer
    preflight.ensure_pad_token(tokenizer, cfg.model.path)   # Llama's tokenizers have no pad token
    if os.environ.get("MEGARL_DEVICE_GUARD") == "1":   # debugging: fail on any host/device mix-up
        from megarl.distributed.device_guard import DeviceGuard
        DeviceGuard().__enter__()
    stop = StopSignal(cfg.checkpoint.time_budget_min)

    # resume: models, optimizers, data cursor and RNG from the newest complete checkpoint
    start = 0
    found = [resume_from] if resume_from is not None else []
    if found:
        driver = ckpt.load(found[-1], models.actor, models.critic)
        sampler.load_state_dict(driver["sampler"])
        ckpt.set_rng_state(driver["rng"])
        start = driver["step"] + 1

    is_driver = env.rank == 0
    pool, logger, rollout = None, None, None
    if is_driver:
        save_config(cfg, os.path.join(cfg.run.dir, "config.yaml"))
        pool = open_pool(cfg.rollout, cfg.model.path, cfg.run.seed, os.path.join(cfg.run.dir, "engines"),
                         weight_backend(cfg.weight_sync))
        rollout = Rollout(cfg, pool, records, sampler, tokenizer, reward_fn)
        if found and "rollout" in driver:  # the carry: partial samples, untrained groups
            rollout.load_state_dict(driver["rollout"])
        logger = MetricsLogger(cfg.run.dir, cfg.train.steps, cfg.metrics.tensorboard,
                               cfg.metrics.progress, start_step=start)
        if found:
            logger.bar.write(f"resumed from {found[-1]} at step {start}")
        if start >= cfg.train.steps:
            logger.bar.write(f"nothing to do: the checkpoint is at step {start - 1} and train.steps="
                             f"{cfg.train.steps}; raise train.steps, or checkpoint.resume=false to start over")

    def save(step: int) -> None:
        driver_state = {"step": step, "version": step + 1, "sampler": sampler.state_dict(),
                        "rng": ckpt.rng_state()}
        if rollout is not None:
            driver_state["rollout"] = rollout.state_dict()
        ckpt.save(cfg.checkpoint_dir, step, models.actor, models.critic, driver_state,
                  OmegaConf.to_yaml(OmegaConf.structured(cfg)), cfg.checkpoint.keep)

    transport = weight_sync.open_transport(cfg.weight_sync, pool)

    def push(version: int) -> dict:
        return transport.push(models.actor.model, models.actor.info, version)

    last, step = {}, start - 1
    try:
        # the engines start from the HF files (or older weights on resume): push before rolling out
        push(start)
        for step in range(start, cfg.train.steps):
            t_step = time.perf_counter()
            samples, partials, round_metrics = None, None, {}
            if is_driver:
                samples, round_metrics = rollout.round(step)
                partials = rollout.pending()
                if step + 1 < cfg.train.steps:
                    rollout.prefetch(step + 1)   # rollout.async: the next round runs while we train
                if cfg.rollout.dump_every and step % cfg.rollout.dump_every == 0:
                    dump_samples(cfg.run.dir, step, samples, tokenizer)
            rollout_s = time.perf_counter() - t_step
            samples = from_rank0(samples)

            t_train = time.perf_counter()
            # stitching: l_old of the carried tokens, under the weights that made them (every
            # rank takes part: the carry goes out from the driver as tensors, split over DP)
            old = trainer_logprobs(cfg, models.actor, partials, tokenizer.pad_token_id)
            if is_driver and old:
                rollout.store(old)
            batch = build_batch(samples, tokenizer.pad_token_id,
                                cfg.parallel.tp if cfg.parallel.sequence_parallel else 1)
            extra = {}
            if models.reward_model is not None:  # scored on the trainer ranks, all of them together
                rm = reward_model.score(models.reward_model, batch, cfg.train.micro_batch_size)
                batch.scores = batch.scores + cfg.reward.model_coef * rm
                extra["rm_score_mean"] = float(rm.mean())
            metrics = ppo_step(cfg, models.actor, models.reference, models.critic, batch, step)
            train_s = time.perf_counter() - t_train

            sync = push(step + 1)
            if cfg.weight_sync.verify:
                probe = [s.prompt_ids for s in samples[:: cfg.rollout.n]]
                sync["sync_verify_gap"] = weight_sync.verify(models.actor, pool, probe, 8,
                                                             cfg.train.micro_batch_size,
                                                             cfg.rollout.temperature)
            if is_driver:
                step_s = time.perf_counter() - t_step
                last = {**rollout_metrics(samples, batch), **round_metrics, **reward_fn.take_counts(),
                        **extra, **metrics, **sync,
                        "rollout_time_s": rollout_s, "train_time_s": train_s, "step_time_s": step_s,
                        # the trainer waits while the round generates (no overlap yet)
                        "trainer_idle_frac": rollout_s / step_s, "weight_version": pool.version}
                logger.log(step, last)
            faults.point("step_end")
            if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0:
                save(step)
            if stop.should_stop():
                if is_driver:
                    logger.bar.write(f"stopping after step {step} ({stop.reason}): saving a checkpoint")
                break
        if step >= start:
            finished_on_schedule = cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0
            if not finished_on_schedule:
                save(step)
    finally:
        reward_fn.close()
        if is_driver:
            transport.close()
            logger.close()
            pool.close()
        parallel.destroy()
        if lock is not None:
            lock.release()
    return last


def _lock_run_dir(run_dir: str, is_rank0: bool):
    """Collective: rank 0 takes the run directory's lock; a refusal raises the same
    ConfigError on every rank (none is left waiting)."""
    from megarl.checkpoint.run_lock import RunLock
    lock, problem = None, None
    if is_rank0:
        lock = RunLock(run_dir)
        try:
            lock.acquire()
        except ConfigError as err:
            lock, problem = None, str(err)
    problem = from_rank0(problem)
    if problem:
        raise ConfigError(problem)
    return lock


def _agree(check, is_rank0: bool):
    """Collective: rank 0 runs `check` (the others wait for its verdict); a ConfigError it
    raises is raised on every rank, else every rank gets its result."""
    result, problem = None, None
    if is_rank0:
        try:
            result = check()
        except ConfigError as err:
            problem = str(err)
    result, problem = from_rank0((result, problem))
    if problem:
        raise ConfigError(problem)
    return result


def rollout_metrics(samples, batch) -> dict:
    lengths = [len(s.response_ids) for s in samples]
    mean = sum(lengths) / len(lengths)
    return {"samples": len(samples),
            "response_len_mean": mean,
            "response_len_max": max(lengths),
            # share of decode slots doing useful work when the whole batch waits for its longest
            # sample: what partial rollout wins back
            "rollout_slot_utilization": mean / max(lengths),
            "finished_frac": sum(s.stopped for s in samples) / len(samples),
            **device.host_values({"reward_mean": batch.scores.mean()})}

