"""`megarl train`: the RL loop, as setup -> step(k) for each step -> finish (`Trainer`).

Rank 0 (the driver) drives the rollout engines and writes metrics; every rank trains. One step
(`Trainer.step`): rollout -> share the samples -> stitch + PPO/GRPO update -> push the weights
to the engines as the next version -> log -> maybe checkpoint. With rollout.partial.async the next
round starts right after this one ended (`Rollout.prefetch`) and generates while the trainer
trains, so `rollout_time_s` is only the wait for what it has not generated yet.
What a checkpoint keeps besides the models is the state of the components registered in
`Trainer.state` (checkpoint/state.py): the data sampler, the RNGs, the driver's rollout.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch

from megarl import preflight
from megarl.bootstrap import bootstrap
from megarl.checkpoint import hf_export
from megarl.checkpoint import manager as ckpt
from megarl.checkpoint.run_lock import RunLock
from megarl.checkpoint.state import GlobalRNG, StateRegistry
from megarl.config import ConfigError, RootConfig, save_config, validate_world
from megarl.config.paths import check_writable
from megarl.config.secrets import redacted_yaml
from megarl.data.mixture import make_sampler
from megarl.data.prompts import check_chat_template, load_dataset
from megarl.distributed import faults, parallel
from megarl.distributed.device_guard import DeviceGuard
from megarl.distributed.env import from_rank0, init_distributed
from megarl.distributed.stop import Stopped, StopSignal
from megarl.eval.datasets import load_eval_sets
from megarl.eval.runner import Evaluator
from megarl.eval.schedule import due
from megarl.metrics.logger import MetricsLogger
from megarl.metrics.speed import SpeedMeter
from megarl.metrics.step import rollout_metrics, trainer_idle_frac
from megarl.metrics.wandb_sink import check_installed
from megarl.models.builders import local_layers
from megarl.models.loading import check_megatron_dir
from megarl.models.sampling_cut import Cut
from megarl.models.setup import build_all, check_model_dir
from megarl.ppo.batch import build_batch
from megarl.ppo.microbatch import batching_of
from megarl.ppo.overlap import Overlap
from megarl.ppo.step import forward_passes, ppo_step, trainer_logprobs
from megarl.rewards import build_verifier, needs_answer
from megarl.rewards import model as reward_model
from megarl.rollout.controller.dump import dump_samples
from megarl.rollout.controller.lag import LagQueue
from megarl.rollout.controller.rounds import Rollout, staleness_metrics
from megarl.rollout.engines import reaper
from megarl.rollout.engines.build import lora_rank, weight_backend
from megarl.rollout.engines.gpus import own_gpus
from megarl.rollout.engines.pool import open_pool
from megarl.rollout.routes import wanted as routes_wanted
from megarl.rollout.weights import sync as weight_sync
from megarl.rollout.weights.files import check_staging_base
from megarl.service.launch import open_service


def train(cfg: RootConfig) -> dict:
    """Runs cfg.train.steps steps (from the newest checkpoint on resume); returns the last
    step's metrics (rank 0; {} elsewhere)."""
    trainer = Trainer(cfg)
    trainer.setup()
    try:
        trainer.run()
    finally:
        trainer.finish()
    return trainer.last


class Trainer:
    """One run: `setup()` checks the inputs, builds models, engines and logger and resumes;
    `run()` pushes the starting weights, then `step(k)` until train.steps or a stop signal,
    then the last checkpoint; `finish()` closes what setup opened."""

    def __init__(self, cfg: RootConfig):
        self.cfg = cfg
        self.pool = self.logger = self.rollout = self.lock = self.transport = self.overlap = self.evaluator = None
        self.lag = None                     # rollout.lag > 0: the driver's queue of rounds (rollout/controller/lag.py)
        self.state = StateRegistry()        # what a checkpoint keeps besides the models
        self.start, self.last = 0, {}
        self.stopped_in_setup = False       # a SIGTERM before the first step: run() trains nothing

    # -- setup -------------------------------------------------------------------------------
    def setup(self) -> None:
        self._start_process()
        self.check_inputs()
        # the newest intact checkpoint (damaged newer ones are named and skipped); all damaged: stop
        cfg = self.cfg
        resume_from = _agree(lambda: ckpt.resume_point(cfg.checkpoint_dir) if cfg.checkpoint.resume else None,
                             self.is_driver)
        # nothing is written before this line: a bad input above leaves no trace
        self.lock = _lock_run_dir(cfg.run.dir, self.is_driver)   # a second run on this run.dir stops here
        self._build_models()
        # resume: models and optimizers now, the registered components once all exist
        driver = None if resume_from is None else ckpt.load(resume_from, self.models.actor, self.models.critic)
        self.start = 0 if driver is None else driver["step"] + 1
        self.state.register("sampler", self.sampler)
        self.state.register("rng", GlobalRNG())
        if self.is_driver:
            self._open_driver_unless_stopped(resume_from)
        if self.stop.should_stop():   # a SIGTERM during setup: no step, nothing new to save
            self.stopped_in_setup = True
            return
        if driver is not None:
            ckpt.restore(driver, self.state)
        self.transport = weight_sync.open_transport(cfg.weight_sync, self.pool, cfg.rollout.engines.mode,
                                                     own_gpus(cfg.rollout.engines))

    def _open_driver_unless_stopped(self, resume_from) -> None:
        """`_open_driver`, cut short by a SIGTERM (the engines' start can take many minutes:
        a pre-empted job must stop within the scheduler's grace period, distributed/stop.py)."""
        try:
            with self.stop.interruptible():
                self._open_driver(resume_from)
        except Stopped:
            pass   # the pool closed what it had started; every rank learns of it in setup

    def _start_process(self) -> None:
        cfg = self.cfg
        local_layers(cfg.model.lora.rank > 0)   # LoRA: megatron's local layers, on GPUs too (models/builders.py)
        self.env = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s)
        self.stop = StopSignal(cfg.checkpoint.time_budget_min)   # a SIGTERM from here on is kept
        self.is_driver = self.env.rank == 0
        validate_world(cfg, self.env.world_size)
        reaper.guard_descendants()   # engines, checkpoint writers: nothing outlives a SIGKILLed rank
        if bootstrap():   # on CPU: the ranks of this machine share its cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.env.world_size))
        parallel.initialize(cfg.parallel.tp, cfg.parallel.pp, cfg.run.seed, cfg.parallel.ep)
        torch.manual_seed(cfg.run.seed)

    def check_inputs(self) -> None:
        """Cheap inputs first: a bad data path or reward name fails before any model is built
        (`setup` runs it, and so does `megarl check`, check.py)."""
        cfg, d = self.cfg, self.cfg.data
        self.records = load_dataset(d, d.answer_key if needs_answer(cfg.reward.fn) else None)
        tokenizer, hf_config = self._check_model()
        check_chat_template(self.records, cfg.model.path, d, d.messages_key, d.prompts, tokenizer)
        # every prompt encodes and fits the engine's context with its response budget, or is dropped
        # (data.overlong_prompts; rank 0 tokenizes the dataset once; every rank gets the verdict)
        _agree(lambda: preflight.check_prompts(self.records, tokenizer, cfg, hf_config.get("vocab_size")),
               self.is_driver)
        self.sampler = make_sampler(self.records, cfg.run.seed, d.shuffle)   # the rows kept (rank 0 draws)
        # episodes: the environment against this data and tokenizer, before any engine starts
        _agree(lambda: preflight.check_episodes(cfg, self.records, tokenizer), self.is_driver)
        # errors and timeouts of a verifier score 0 and are counted (reward_errors / reward_timeouts)
        self.reward_fn = build_verifier(cfg.reward.fn, timeout_s=cfg.reward.timeout_s, answer_key=d.answer_key,
                                        concurrency=cfg.reward.concurrency, batch_size=cfg.reward.batch_size)
        self.eval_sets = load_eval_sets(cfg, self.records if self.is_driver else None)   # read as data.prompts is
        if cfg.reward.model_path:
            check_model_dir(cfg.reward.model_path, "reward.model_path")
            preflight.check_model_files(cfg.reward.model_path, "reward.model_path", tokenizer=False)
        check_writable(cfg.run.dir, "run.dir")
        check_installed(cfg.metrics.wandb)   # metrics.wandb set: the wandb package is here
        if cfg.checkpoint.dir:   # elsewhere than run.dir: refused now, not at the first save
            check_writable(cfg.checkpoint.dir, "checkpoint.dir")
        if cfg.weight_sync.transport == "files":
            check_staging_base(cfg.weight_sync.staging_dir)

    def _check_model(self):
        """model.path (and model.megatron_path) complete and matching; its tokenizer and config."""
        cfg = self.cfg
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
        return tokenizer, hf_config

    def _build_models(self) -> None:
        self.models = build_all(self.cfg)
        self.tokenizer = self.models.tokenizer
        preflight.ensure_pad_token(self.tokenizer, self.cfg.model.path)   # Llama's tokenizers have no pad token
        if os.environ.get("MEGARL_DEVICE_GUARD") == "1":   # debugging: fail on any host/device mix-up
            DeviceGuard().__enter__()
        self.speed = SpeedMeter(self.cfg, self.env.world_size)   # lr, tokens/s, mfu, peak memory per step
        if self.cfg.rollout.overlap:   # the step's forward-only passes, run during the round too
            self.overlap = _overlap(self.cfg, self.models, self.tokenizer.pad_token_id)

    def _open_driver(self, resume_from) -> None:
        """Rank 0: the engines, the rollout on them (its carry is checkpointed) and the logger."""
        cfg, start = self.cfg, self.start
        save_config(cfg, os.path.join(cfg.run.dir, "config.yaml"))
        self.pool = open_pool(cfg.rollout, cfg.model.path, cfg.run.seed, os.path.join(cfg.run.dir, "engines"),
                              weight_backend(cfg.weight_sync, cfg.rollout.engines.mode, own_gpus(cfg.rollout.engines)),
                              routes=routes_wanted(cfg), lora_rank=lora_rank(cfg.model, cfg.weight_sync))
        self.rollout = Rollout(cfg, self.pool, self.records, self.sampler, self.tokenizer, self.reward_fn,
                               service_factory=lambda tasks: open_service(cfg, self.pool, self.tokenizer, tasks))
        if cfg.rollout.lag:   # the rounds generated but not trained yet are the checkpoint's too
            self.lag = LagQueue(cfg.rollout.lag)
            self.state.register("lag", self.lag, optional=True)
        # partial samples and untrained groups; checkpoints older than the carry lack it
        self.state.register("rollout", self.rollout, optional=True)
        self.logger = MetricsLogger.for_run(cfg, start)
        if self.eval_sets:   # held-out evaluation (eval.*, megarl/eval/runner.py)
            self.evaluator = Evaluator(cfg, self.eval_sets, self.pool, self.tokenizer, self.logger, self.stop)
        if resume_from is not None:
            self.logger.bar.write(f"resumed from {resume_from} at step {start}")
        if start >= cfg.train.steps:
            self.logger.bar.write(f"nothing to do: the checkpoint is at step {start - 1} and train.steps="
                                  f"{cfg.train.steps}; raise train.steps, or checkpoint.resume=false to start over")

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        if self.stopped_in_setup:
            if self.is_driver:   # the line the cluster scripts requeue on (slurm/common.sh)
                print(f"stopping before step {self.start} ({self.stop.reason} while starting): "
                      "nothing new to save", flush=True)
            return
        # the engines start from the HF files (or older weights on resume): push before rolling out
        self._push_first()
        last = self._train_steps()
        if last >= self.start and not self._on_schedule(last):
            self.save(last)
        if self.evaluator is not None:   # the final weights (eval.*)
            self.evaluator.at_end(last, self.start)

    def _push_first(self) -> None:
        """push(self.start). On a single trainer rank a SIGTERM cuts it short (distributed/stop.py;
        the vote before the first step then stops the run). With more ranks rank 0 cannot
        leave the push alone (the others would wait in its collectives): the stop waits for
        its end (every engine call in it is bounded by rollout.engines.timeout_s)."""
        alone = self.env.world_size == 1
        try:
            with self.stop.interruptible() if alone else contextlib.nullcontext():
                self.push(self.start)
        except Stopped:
            pass   # nothing was written; finish() closes the engines

    def _train_steps(self) -> int:
        """step(k) from self.start until train.steps or a stop; the last step trained."""
        last = self.start - 1
        for step in range(self.start, self.cfg.train.steps):
            if self._stops_before(step):
                break
            self.step(step)
            last = step
            if self.stop.should_stop():
                if self.is_driver:
                    self.logger.bar.write(f"stopping after step {step} ({self.stop.reason}): saving a checkpoint")
                break
        return last

    def _stops_before(self, step: int) -> bool:
        """Collective, on every rank at the same steps: after the first push and after rank 0
        evaluated version `step` when due (eval.*; its generation cut short by a SIGTERM,
        eval/runner.py), whether to stop before step `step`."""
        if step == self.start and self._vote(step):
            return True
        e = self.cfg.eval
        if not (self.eval_sets and due(step, e.every, self.cfg.train.steps, e.at_start)):
            return False
        if self.evaluator is not None:
            try:
                self.evaluator.at(step)
            except Stopped:
                pass   # nothing of it was logged; every rank learns of the stop in the vote
        return self._vote(step)

    def _vote(self, step: int) -> bool:
        """Collective: True on every rank if any has been signalled (or the time budget is
        spent); run() then saves the step before this one, unless its schedule did."""
        if not self.stop.should_stop():
            return False
        if self.is_driver:   # "stopping before step": the line the cluster scripts requeue on
            saves = step > self.start and not self._on_schedule(step - 1)
            self.logger.bar.write(f"stopping before step {step} ({self.stop.reason}): "
                                  f"{'saving a checkpoint' if saves else 'nothing new to save'}")
        return True

    def step(self, step: int) -> None:
        """One step (its evaluation, when due, ran just before: `_stops_before`)."""
        t_step = time.perf_counter()
        self.speed.start()
        lagged = self.cfg.rollout.lag > 0
        samples, partials, round_metrics = self.generate_lagged(step) if lagged else self.generate(step)
        rollout_s = time.perf_counter() - t_step
        samples = from_rank0(samples)
        t_train = time.perf_counter()
        batch, metrics = self.update(step, samples, partials)
        train_s = time.perf_counter() - t_train
        sync = self.push(step + 1, samples)
        if self.is_driver:
            step_s = time.perf_counter() - t_step
            self.last = {**rollout_metrics(samples, batch), **round_metrics, **self.reward_fn.take_counts(),
                         **metrics, **sync, **self.speed.metrics(step, self.models, samples, round_metrics,
                                                                 rollout_s, train_s),
                         "rollout_time_s": rollout_s, "train_time_s": train_s, "step_time_s": step_s,
                         "trainer_idle_frac": trainer_idle_frac(train_s, step_s, metrics.get("overlap_forward_s", 0.0)),
                         "weight_version": self.pool.version, "data_prompts_dropped": self.records.dropped}
            self.logger.log(step, self.last)
        faults.point("step_end")
        if self._on_schedule(step):
            self.save(step)
        hf_export.after_step(self.cfg, step, self.models.actor)   # checkpoint.hf_every / hf_final

    def generate(self, step: int, dump: bool = True):
        """Rank 0: the round's samples and metrics, and the carried partial samples whose new
        tokens need l_old; the next round starts now in async mode. Elsewhere: nothing."""
        serve = None if self.overlap is None else self.overlap.serve
        if not self.is_driver:
            if serve is not None:   # the driver's round: its groups' forward-only passes, as they come
                serve(step)
            return None, None, {}
        cfg = self.cfg
        during = None if serve is None else (lambda finished, emitted: serve(step, finished, emitted))
        samples, round_metrics = self.rollout.round(step, during)
        partials = self.rollout.pending()
        if step + 1 < cfg.train.steps:
            self.rollout.prefetch(step + 1)   # rollout.partial.async: the next round runs while we train
        if dump and cfg.rollout.dump_every and step % cfg.rollout.dump_every == 0:
            dump_samples(cfg.run.dir, step, samples, self.tokenizer)
        return samples, partials, round_metrics

    def generate_lagged(self, step: int):
        """rollout.lag=K (every rank): generate the rounds the queue lacks (K + 1 at the start,
        then one), each with its l_old computed now, under the weights that generated it; the
        step trains the oldest. Rank 0 returns it (dumped as the step's samples: what was
        trained), the others nothing."""
        cfg, pad = self.cfg, self.tokenizer.pad_token_id
        missing = from_rank0(self.lag.missing() if self.is_driver else None)
        for _ in range(missing):
            samples, _, metrics = self.generate(step, dump=False)
            old = trainer_logprobs(cfg, self.models.actor, samples, pad)   # collective
            if self.is_driver:
                for sample, values in zip(samples, old):
                    sample.old_logprobs = values
                self.lag.put(samples, metrics)
        if not self.is_driver:
            return None, None, {}
        samples, metrics = self.lag.take()
        if cfg.rollout.dump_every and step % cfg.rollout.dump_every == 0:
            dump_samples(cfg.run.dir, step, samples, self.tokenizer)
        # staleness against the version that trains them (K at every step from step K on)
        return samples, [], {**metrics, **staleness_metrics(samples, step), "lag_rounds_queued": len(self.lag.rounds)}

    def update(self, step: int, samples, partials):
        """Every rank: stitched l_old of the carry, the batch (+ reward model), the PPO/GRPO step."""
        cfg, models, pad = self.cfg, self.models, self.tokenizer.pad_token_id
        # stitching: l_old of the carried tokens, under the weights that made them (every
        # rank takes part: the carry goes out from the driver as tensors, split over DP)
        old = trainer_logprobs(cfg, models.actor, partials, pad)
        if self.is_driver and old:
            self.rollout.store(old)
        batch = build_batch(samples, pad, cfg.parallel.tp if cfg.parallel.sequence_parallel else 1)
        extra = {}
        # rollout.overlap: the passes computed during the round, the rest now (group by group)
        forward = None if self.overlap is None else self.overlap.forward(samples, batch, step)
        if models.reward_model is not None:  # scored on the trainer ranks, all of them together
            rm = reward_model.sequence_scores(models.reward_model, batch, batching_of(cfg), forward)
            batch.scores = batch.scores + cfg.reward.model_coef * rm
            extra["rm_score_mean"] = float(rm.mean())
        metrics = ppo_step(cfg, models.actor, models.reference, models.critic, batch, step, forward)
        if self.overlap is not None:   # the weights changed: the cache keeps only frozen models' values
            extra.update(self.overlap.after_update(samples))
        return batch, {**extra, **metrics}

    def push(self, version: int, samples=None) -> dict:
        """The actor's weights to the engines as `version`; after a step (`samples` given)
        with weight_sync.verify also the engines' logprob gap on a probe of its prompts."""
        cfg = self.cfg
        sync = self.transport.push(self.models.actor.model, self.models.actor.info, version)
        if samples is not None and cfg.weight_sync.verify:
            probe = [s.prompt_ids for s in samples[:: cfg.rollout.sampling.n]]
            rows, temperature = cfg.train.rows_per_micro_batch, cfg.rollout.sampling.temperature
            sync["sync_verify_gap"] = weight_sync.verify(self.models.actor, self.pool, probe, 8, rows, temperature,
                                                         cut=Cut.of(cfg.rollout.sampling))
        return sync

    # -- checkpoints and the end -------------------------------------------------------------
    def _on_schedule(self, step: int) -> bool:
        return bool(self.cfg.checkpoint.every) and (step + 1) % self.cfg.checkpoint.every == 0

    def save(self, step: int) -> None:
        cfg = self.cfg
        ckpt.save(cfg.checkpoint_dir, step, self.models.actor, self.models.critic, self.state,
                  redacted_yaml(cfg), cfg.checkpoint.keep)

    def finish(self) -> None:
        self.reward_fn.close()
        if self.is_driver:   # what setup opened: all of it, or what it had when a SIGTERM stopped it
            if self.evaluator is not None:
                self.evaluator.close()
            for opened in (self.transport, self.logger):
                if opened is not None:
                    opened.close()
            try:   # the environments' loop, the agent service: closed before the engines they use
                if self.rollout is not None:
                    self.rollout.close()
            finally:
                if self.pool is not None:
                    self.pool.close()
        parallel.destroy()
        if self.lock is not None:
            self.lock.release()


def _overlap(cfg: RootConfig, models, pad_id: int) -> Overlap:
    """rollout.overlap: the passes of `ppo_step` (and the reward model's) on every rank."""
    passes = list(forward_passes(cfg, models.actor, models.reference, models.critic).values())
    if models.reward_model is not None:
        passes.append(reward_model.score_pass(models.reward_model))
    multiple = cfg.parallel.tp if cfg.parallel.sequence_parallel else 1
    return Overlap(passes, pad_id, multiple, batching_of(cfg))


def _lock_run_dir(run_dir: str, is_rank0: bool):
    """Collective: rank 0 takes the run directory's lock; a refusal raises the same
    ConfigError on every rank (none is left waiting)."""
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
