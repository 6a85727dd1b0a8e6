"""Trainer -> engines weight sync: the seam between the trainer and the transports.

How the actor's weights reach the engines is `weight_sync.transport` (megarl/rollout/weights/):
`collective` (rank 0 sends each bucket once to every engine worker through vLLM's
weight-transfer session, nothing on disk; the wire is weight_sync.backend, gloo on CPU, on GPU
ipc for engines megarl starts and nccl for remote ones, see rollout/weights/wires.py) or `files`
(safetensors staged in a folder the engines reload from). `open_transport` picks one; its
`push(model, info, version)` is collective over all trainer ranks. `verify` (the trainer
calls it after a push when weight_sync.verify is set) checks that every engine samples with
the trainer's logprobs.
"""
from __future__ import annotations

import math

from megarl.data.sample import Sample
from megarl.distributed.env import from_rank0
from megarl.models.sampling_cut import NO_CUT, Cut
from megarl.ppo import actor as actor_ops
from megarl.ppo.batch import build_batch
from megarl.rollout.engines.engine import GenRequest, RequestError
from megarl.rollout.weights.collective import CollectiveTransport
from megarl.rollout.weights.files import FilesTransport


def open_transport(ws, pool, engine_mode: str = "remote", own_gpus: bool = False):
    """The transport of `ws` (a WeightSyncConfig), on every trainer rank; `pool` is the
    SyncPool on global rank 0, None elsewhere; `engine_mode`: rollout.engines.mode, and
    `own_gpus` (engines megarl starts on GPUs of their own), which weight_sync.backend=auto
    resolves with (WeightSyncConfig.resolved_backend)."""
    if ws.transport == "files":
        return FilesTransport(ws, pool)
    return CollectiveTransport(ws, pool, engine_mode, own_gpus)


class WeightSyncError(RuntimeError):
    """The engine's policy is not the trainer's after a push."""


def engine_mismatch(actor, pool, prompts: list[list[int]], max_tokens: int, micro_batch_size: int,
                    temperature: float = 1.0, cut: Cut = NO_CUT) -> dict[str, float]:
    """Per engine of `pool`: mean |engine logprob - trainer logprob| over tokens that engine
    samples now at `temperature` and top-k / top-p `cut`, the trainer renormalising over the
    same set (fp32: ~1e-6 when it holds the trainer's weights).
    Collective over all trainer ranks; `pool` is a SyncPool on global rank 0, None elsewhere.
    A probe that cannot run (`probe_engines`) raises WeightSyncError on every rank."""
    per_engine = None
    if pool is not None:
        try:
            per_engine = probe_engines(pool, prompts, max_tokens, temperature, cut)
        except WeightSyncError as err:    # every rank raises it, none waits for rank 0's samples
            per_engine = str(err)
    per_engine = from_rank0(per_engine)
    if isinstance(per_engine, str):
        raise WeightSyncError(per_engine)
    gaps = {}
    for name, samples in per_engine.items():
        batch = build_batch(samples, pad_id=0)
        mbs = micro_batch_size if batch.size % micro_batch_size == 0 else 1
        trainer = actor_ops.logprobs(actor.model, batch, mbs, actor.info.vocab_size, temperature, cut)
        mask = batch.resp_mask
        gaps[name] = float(((trainer - batch.behav_logp).abs() * mask).sum() / mask.sum())  # one sync per engine
    return gaps


def probe_engines(pool, prompts: list[list[int]], max_tokens: int, temperature: float,
                  cut: Cut = NO_CUT) -> dict[str, list[Sample]]:
    """Rank 0: per engine of `pool` (a SyncPool), `prompts` sampled on that engine, as Samples.
    A prompt the engine refuses as invalid (RequestError: longer than its max_model_len, ...)
    says nothing about the weights: it is left out, and no engine is retired for it. An engine
    that refuses every prompt cannot be checked: WeightSyncError naming it."""
    per_engine = {}
    for e in list(pool.engines):
        reqs = [GenRequest(f"probe-{e.name}-{i}", p, max_tokens, temperature, cut.top_p, seed=i, top_k=cut.top_k)
                for i, p in enumerate(prompts)]
        outs = pool.call(pool.pool.generate_each(reqs, e), f"probing {e.name}")
        kept = [Sample(p, r.token_ids, r.logprobs, r.versions, r.stopped, i)
                for i, (p, r) in enumerate(zip(prompts, outs)) if not isinstance(r, RequestError)]
        if not kept:
            raise WeightSyncError(
                f"engine {e.name} refused every weight-sync verify probe prompt ({len(prompts)}) as invalid, so the "
                f"push cannot be checked: {outs[0]}. The probe samples {max_tokens} tokens after prompts of the step; "
                f"weight_sync.verify=false skips the check")
        per_engine[e.name] = kept
    return per_engine


def verify(actor, pool, prompts, max_tokens: int, micro_batch_size: int, temperature: float = 1.0,
           tol: float = 1e-3, cut: Cut = NO_CUT) -> float:
    """Raise WeightSyncError when any engine's logprobs differ from the trainer's by more
    than tol (sampled at the run's temperature and `cut`: the check covers the trainer's
    renormalisation too); returns the largest gap."""
    gaps = engine_mismatch(actor, pool, prompts, max_tokens, micro_batch_size, temperature, cut)
    # NaN first: an engine whose probe returned no tokens has gap 0/0 = NaN, and NaN > tol is False
    name, gap = max(gaps.items(), key=lambda kv: math.inf if math.isnan(kv[1]) else kv[1])
    if math.isnan(gap):
        raise WeightSyncError(
            f"engine {name} returned no tokens (or NaN logprobs) for the weight-sync verify probe: the "
            f"push cannot be checked; see the engine's log (weight_sync.verify=false skips the check)")
    if gap > tol:
        version = pool.version if pool is not None else "?"
        raise WeightSyncError(
            f"engine {name} logprobs differ from the trainer's by {gap:.3g} (> {tol}) at weight "
            f"version {version}: the push did not reach the engine (or the mapping is wrong); "
            f"check weight_sync.staging_dir and the conversion table")
    return gap
