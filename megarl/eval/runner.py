"""The held-out evaluation of a run (eval.*, docs/evaluation.md), on the driver (trainer rank 0).

`Evaluator.at(step)` evaluates the weights the engines hold at the top of step `step` (version
`step`, pushed at the end of the step before) when the schedule says so (eval/schedule.py), and
`at_end` the final weights after the last step. It runs before the step's round: in sync and
partial mode no round is in flight then (a round ends by pausing the engines in
rollout.update_mode=keep, which would hold the evaluation's requests too), in async mode
beside the prefetched round, whose accounting counts its own requests only (eval/generate.py).

It changes nothing that trains: its requests draw from a seed stream of their own
(seeds.eval_prompt_seed), each dataset is scored by a verifier instance of its own (the step's
reward_errors count the training's only), and in sync mode the engines' prefix cache, which
the evaluation's prompts filled, is emptied again, so the round starts from the cache the
push left, as without evaluation. Its rows go to metrics.jsonl / TensorBoard at step `version`
beside the step's row, with one console line.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from megarl.data.prompts import encode_prompts
from megarl.data.sample import Sample
from megarl.eval.answers import extractor_of
from megarl.eval.datasets import EvalSet
from megarl.eval.generate import eval_requests, run_requests
from megarl.eval.report import answers_of, console_line, dataset_metrics, dump_eval
from megarl.eval.schedule import due
from megarl.rewards import build_verifier
from megarl.rollout.controller.scoring import score_all
from megarl.rollout.controller.sync_rollout import samples_of

log = logging.getLogger("megarl.eval")


class Evaluator:
    """Evaluations of the run's held-out datasets on the engine pool (a SyncPool)."""

    def __init__(self, cfg, sets: list[EvalSet], pool, tokenizer, logger, stop=None):
        self.cfg, self.sets, self.pool, self.tokenizer, self.logger = cfg, sets, pool, tokenizer, logger
        self.stop = stop   # the run's StopSignal (distributed/stop.py): a SIGTERM cuts `at`'s generation
        d = cfg.data
        self.prompts = [encode_prompts(tokenizer, s.records, d) for s in sets]
        self.verifiers = [build_verifier(s.verifier, timeout_s=cfg.reward.timeout_s, answer_key=d.answer_key,
                                         concurrency=cfg.reward.concurrency, batch_size=cfg.reward.batch_size)
                          for s in sets]
        self.extractors = [extractor_of(s.verifier) for s in sets]
        self._cache_warned = False

    def at(self, step: int) -> None:
        """Evaluate version `step` if the schedule says so (at the top of step `step`). A
        SIGTERM during its generation (or before it) raises Stopped: the trainer stops before
        the step (train.py), nothing of this evaluation logged."""
        e = self.cfg.eval
        if due(step, e.every, self.cfg.train.steps, e.at_start):
            self.run(step, interruptible=True)

    def at_end(self, last_step: int, start: int) -> None:
        """After the run's last step (`last_step` == train.steps - 1, trained by this process):
        the final weights, version train.steps. Not cut by a SIGTERM: the last checkpoint is
        saved by then, and a rerun would not evaluate them again."""
        steps = self.cfg.train.steps
        if last_step == steps - 1 and last_step >= start:
            self.run(steps)

    def run(self, version: int, interruptible: bool = False) -> dict:
        """Every dataset at the engines' weights, logged as one row at step `version`.
        `interruptible` (with a StopSignal): a dataset's generation runs inside
        `interruptible()`, where a SIGTERM raises Stopped and its requests are cancelled;
        scoring, dumps and the row are never cut (a dataset scored before keeps its dump)."""
        t0, metrics = time.perf_counter(), {}
        cut = self.stop.interruptible if interruptible and self.stop is not None else contextlib.nullcontext
        for s, prompts, verifier, extract in zip(self.sets, self.prompts, self.verifiers, self.extractors):
            with cut():
                pass        # a SIGTERM already received stops here, before any request is sent
            samples = self._generate(s, prompts, version, cut)
            metrics.update(self._score(s, samples, verifier, extract, version))
        if self.cfg.rollout.mode == "sync":
            self._empty_prefix_cache()
        seconds = time.perf_counter() - t0
        metrics.update({"eval/weight_version": self.pool.version, "eval/time_s": seconds})
        self.logger.log(version, metrics, line=console_line(version, [s.name for s in self.sets], metrics, seconds))
        return metrics

    def _generate(self, s: EvalSet, prompts: list[list[int]], version: int,
                  cut=contextlib.nullcontext) -> list[Sample]:
        e, r = self.cfg.eval, self.cfg.rollout.sampling
        requests = eval_requests(version, s.index, prompts, e.n, e.max_new_tokens or r.max_new_tokens,
                                 e.temperature, self.cfg.run.seed, e.top_p)
        outcomes = run_requests(self.pool, requests, e.concurrency, f"eval {s.name}", self.cfg.metrics.progress, cut)
        return samples_of(outcomes, s.records, prompts, e.n)   # a refused request: scored 0, counted

    def _score(self, s: EvalSet, samples: list[Sample], verifier, extract, version: int) -> dict:
        e = self.cfg.eval
        score_all(samples, self.tokenizer, verifier)
        answers = answers_of(samples, self.tokenizer, extract)
        if e.dump:
            dump_eval(self.cfg.run.dir, s.name, version, samples, answers, e.n, e.pass_threshold, self.tokenizer)
        return dataset_metrics(s.name, samples, answers, e.n, e.pass_threshold, e.k, verifier.take_counts())

    def _empty_prefix_cache(self) -> None:
        """Sync mode: drop the prefix cache the evaluation's prompts filled (no request runs
        between rounds). An engine that cannot (a remote server without VLLM_SERVER_DEV_MODE, a
        simulated one) keeps its cache, said once: its rounds may then reuse the evaluation's
        prompt blocks, computed in other batches, and differ from a run without evaluation in
        the last bits."""
        async def empty():
            return await asyncio.gather(*(e.clear_kv() for e in self.pool.engines), return_exceptions=True)
        failed = [r for r in self.pool.call(empty(), "emptying the engines' prefix cache after the evaluation")
                  if isinstance(r, Exception)]
        if failed and not self._cache_warned:
            self._cache_warned = True
            log.warning("megarl: the engines' prefix cache could not be emptied after the evaluation (%s); "
                        "the rounds after it may reuse the evaluation's prompt blocks", failed[0])

    def close(self) -> None:
        for v in self.verifiers:
            v.close()
