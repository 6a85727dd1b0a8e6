"""Subprocess body of test_pool_sync: weight sync from several trainer layouts into a pool.

Run under torchrun with 4 ranks. Rank 0 opens one engine pool per engine mode (one
engine each: in-process, a local vLLM server it starts, and/or a running vLLM server reached
as a remote engine (`remote=URL`, its key in $MEGARL_ENGINE_API_KEY); each able to take
either transport);
then for each layout TP=2, PP=2 and TP=2 x PP=2 (in that order, in the same world) every rank
builds the actor from the tiny model, and for each transport (collective, then files) perturbs
its weights (so an engine that missed the push cannot match by accident), pushes them as a new
version, and measures per engine the mean |engine - trainer| logprob of tokens the engine
samples at temperature 0.7. During the collective pushes the staging folder is read-only and
safetensors' writer is counted: nothing may be staged. At TP=2 (TP=2 x PP=1) and TP=1 (PP=2),
after the files push, every engine also samples at top-k / top-p cuts (`CUTS`), and the
trainer's logprobs of those tokens are taken renormalised as the engine did and, on purpose,
wrongly (over the whole vocabulary; over the top-k set ignoring top-p). Finally one push per
transport silently drops a bucket, which the same measure must expose (the sharded route,
weight_sync.sharded at TP x PP > 1, refuses such a push before sending, naming the tensors
its senders leave uncovered: the engines keep the old weights). The keep-mode check starts a
request as the last collective push pauses the engines (with weight_sync.staged the pause is
the swap at the push's end), so the swap always holds it. Before the first push, rank 0 runs the
engine contract (tests/engine_contract.py) on the in-process engine, whose weights are still
the model folder's (its logprobs' reference: a transformers forward of them).
usage: pool_sync_probe.py MODEL_DIR OUT_JSON ENGINE_MODES STAGING_BASE LOG_DIR
ENGINE_MODES: comma-separated, each inprocess, local_servers or remote=URL (reported as remote)
"""
import dataclasses
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: engine_contract

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)

TEMPERATURE = 0.7
# rollout.sampling.top_k / top_p as recipes set them; each binds on the tiny model at T=0.7
CUTS = {"top_k": dict(top_k=20), "top_p": dict(top_p=0.7), "both": dict(top_k=20, top_p=0.9)}


def cut_gaps(actor, info, pools, prompts) -> dict:
    """Per cut of CUTS, engine and trainer variant, the largest |engine - trainer| logprob over
    the tokens the engine sampled under that cut: "right" renormalises over the engine's kept
    set, "no_renorm" takes the whole vocabulary, "top_k_only" the top-k set ignoring top-p; and
    "mismatch/<cut>/<engine>", weight_sync.engine_mismatch's mean gap at that cut (the
    trainer's weight_sync.verify check). Collective over all trainer ranks."""
    from megarl.distributed.env import from_rank0
    from megarl.models.sampling_cut import NO_CUT, Cut
    from megarl.ppo import actor as actor_ops
    from megarl.ppo.batch import build_batch
    from megarl.rollout.weights import sync as weight_sync
    out = {}
    for name, kw in CUTS.items():
        cut = Cut(**kw)
        variants = {"right": cut, "no_renorm": NO_CUT}
        if cut.top_k > 0 and cut.top_p < 1:
            variants["top_k_only"] = Cut(top_k=cut.top_k)
        for mode, pool in pools.items():
            per_engine = from_rank0(weight_sync.probe_engines(pool, prompts, 16, TEMPERATURE, cut)
                                    if pool is not None else None)
            for engine, samples in per_engine.items():
                batch = build_batch(samples, pad_id=0)
                for variant, c in variants.items():
                    trainer = actor_ops.logprobs(actor.model, batch, 1, info.vocab_size, TEMPERATURE, c)
                    gap = ((trainer - batch.behav_logp).abs() * batch.resp_mask).max()
                    out[f"{name}/{mode}/{engine}/{variant}"] = float(gap)
            gaps = weight_sync.engine_mismatch(actor, pool, prompts, 16, 1, TEMPERATURE, cut)
            out.update({f"mismatch/{name}/{mode}/{k}": v for k, v in gaps.items()})
    return out


def contract(pool, model_dir: str, scratch: str) -> list[str]:
    """The engine contract on the pool's in-process engine: the checks that passed, in order
    (other weights for the held-request checks written under `scratch`)."""
    import engine_contract

    hf = engine_contract.hf_model(model_dir)
    changed = engine_contract.changed_weights(model_dir, f"{scratch}/changed_weights")
    hf_changed = engine_contract.hf_model(changed)
    engine = pool.engines[0]

    def prompt(i):
        rng = random.Random(i)
        return [1] + [rng.randrange(4, 128) for _ in range(15)]
    subject = engine_contract.Subject(
        engine, prompt=prompt, weights=model_dir, long=200, progress=engine.progress, settle_s=0.3,
        reference=lambda p, toks, t: engine_contract.hf_logprobs(hf, p, toks, t),
        changed=(changed, lambda p, toks, t: engine_contract.hf_logprobs(hf_changed, p, toks, t)))
    done = pool.call(engine_contract.run_all(subject), "the engine contract", 600)
    print(f"engine contract measured: {engine_contract.MEASURED}", flush=True)
    return done


def start_held(mode: str, pool):
    """Rank 0: a long request on the pool's engine, streaming when this returns (the push that
    follows holds it: rollout.update_mode=keep, the default): (request, its future)."""
    import time

    from megarl.rollout.engines.engine import GenRequest
    req = GenRequest(f"held-{mode}", [1, 7, 9, 11, 13], 200, TEMPERATURE, seed=3, ignore_eos=True)
    fut = pool.loop.submit(pool.pool.generate(req, pool.engines[0]))
    deadline = time.monotonic() + 60
    while True:
        part = pool.pool.partial(req.key)
        if part is not None and len(part.token_ids) >= 3:
            return req, fut
        assert time.monotonic() < deadline and not fut.done(), f"{mode}: the held request never streamed"
        time.sleep(0.002)


def hold_at_the_swap(mode: str, pool, held: dict) -> None:
    """Rank 0: the pool's next begin_update (the pause: with weight_sync.staged, the swap at the
    push's end, after the engines generated through the wire) first starts a long request on
    the engine and waits until it streams, so the swap finds it in flight; (request, its
    future) in `held[mode]`. The wrapper removes itself.

    The precondition is checked, not assumed: on a loaded machine a server's stream can reach
    this client late, the whole request at once, after the server ended it (seen: 200 tokens,
    all before the pause). So after the pause the request must still be held by the server
    (its own count, engines/held_tokens.py; in-process: not ended); else the engine resumes and
    another request is tried, up to 5."""
    import asyncio

    from megarl.rollout.engines.engine import GenRequest
    original = pool.pool.begin_update
    engine = pool.engines[0]

    async def held_by_the_server(req, fut) -> bool:
        counts = await engine.held_counts() if hasattr(engine, "held_counts") else None
        return req.key in counts if counts is not None else not fut.done()

    async def begin_update(*args, **kwargs):
        pool.pool.begin_update = original
        engines = None
        for attempt in range(5):
            req = GenRequest(f"held-{mode}-{attempt}", [1, 7, 9, 11, 13], 200, TEMPERATURE, seed=3,
                             ignore_eos=True)
            fut = asyncio.run_coroutine_threadsafe(pool.pool.generate(req, engine), asyncio.get_running_loop())
            while (part := pool.pool.partial(req.key)) is None or len(part.token_ids) < 3:
                if fut.done():
                    break
                await asyncio.sleep(0.002)
            if engines is None:
                engines = await original(*args, **kwargs)
            else:
                await engine.pause()
            if await held_by_the_server(req, fut):
                held[mode] = (req, fut)
                return engines
            await engine.resume()       # it ended before the pause held it: try another
        raise AssertionError(f"{mode}: no request was still generating when the engine paused, in 5 tries")
    pool.pool.begin_update = begin_update


def held_gaps(actor, info, held: dict | None, version: int) -> dict:
    """Collective: per engine, the held request's versions (old then `version`, both present)
    and the largest |engine - trainer| logprob over its tokens of `version`, the trainer's
    forward over the whole sequence under the pushed weights."""
    from megarl.data.sample import Sample
    from megarl.distributed.env import from_rank0
    from megarl.ppo import actor as actor_ops
    from megarl.ppo.batch import build_batch
    samples = None
    if held is not None:
        samples = {}
        for mode, (req, fut) in held.items():
            r = fut.result(120)
            samples[mode] = Sample(req.prompt_ids, r.token_ids, r.logprobs, r.versions, r.stopped, 0)
    samples = from_rank0(samples)
    out = {}
    for mode, smp in samples.items():
        batch = build_batch([smp], pad_id=0)
        trainer = actor_ops.logprobs(actor.model, batch, 1, info.vocab_size, TEMPERATURE)[0]
        new = [i for i, v in enumerate(smp.versions) if v == version]
        out[mode] = {"versions": sorted(set(smp.versions)), "new_tokens": len(new),
                     "old_tokens": len(smp.versions) - len(new),
                     "new_are_the_last": bool(new) and new == list(range(new[0], len(smp.versions))),
                     "gap": max((abs(float(trainer[i]) - smp.logprobs[i]) for i in new), default=float("nan"))}
    return out


def close_all(transports: dict, pools: dict) -> None:
    """Close every transport, then every pool that started (None: a mode that did not)."""
    for t in transports.values():
        t.close()
    for pool in pools.values():
        if pool is not None:
            pool.close()


def main(model_dir: str, out_path: str, modes: str, staging: str, logs: str) -> None:
    from megarl.config import load_config
    from megarl.distributed import cpu, parallel
    from megarl.distributed.env import init_distributed

    cfg = load_config("recipes/tiny_cpu.yaml", [
        f"model.path={model_dir}", f"data.prompts={model_dir}/prompts.jsonl", "run.dir=unused",
        "rollout.engines.count=1", f"rollout.sampling.temperature={TEMPERATURE}",
        # files: staging_dir is read (each transport below is this config with its own transport)
        "weight_sync.transport=files", f"weight_sync.staging_dir={staging}", "rollout.engines.timeout_s=60"])
    env = init_distributed("gloo")
    cpu.apply()
    torch.set_num_threads(1)
    import os

    import safetensors.torch
    from transformers import AutoConfig

    from megarl.formats.hf_reader import HFCheckpoint
    from megarl.models.builders import build_model, make_trainable
    from megarl.models.loading import load_hf_shard
    from megarl.models.transformer_config import transformer_config
    from megarl.rollout.engines.pool import open_pool
    from megarl.rollout.weights import files, pieces, source
    from megarl.rollout.weights import sync as weight_sync
    writes = {"n": 0}
    real_save = safetensors.torch.save_file

    def counted_save(*a, **k):
        writes["n"] += 1
        return real_save(*a, **k)
    files.save_file = counted_save
    import tempfile

    def weight_files() -> set:
        """Weight-like files anywhere a sync could stage them: shared memory, the temp
        folder (top level and megarl's folders) and the staging base."""
        found = set()
        for base in {"/dev/shm", tempfile.gettempdir(), staging}:
            for root, dirs, names in os.walk(base):
                if root != base and "megarl" not in root:
                    dirs[:] = []
                    continue
                found.update(os.path.join(root, n) for n in names
                             if n.endswith(".safetensors") or "megarl-weights" in n)
        return found
    pools, transports = {}, {}
    for mode in modes.split(","):
        mode, _, url = mode.partition("=")
        engines = dataclasses.replace(cfg.rollout.engines, mode=mode, **({"urls": [url]} if url else {}))
        c = dataclasses.replace(cfg.rollout, engines=engines)
        pools[mode] = open_pool(c, model_dir, 0, f"{logs}/{mode}", "gloo") if env.rank == 0 else None
        for kind in ("collective", "files"):
            ws = dataclasses.replace(cfg.weight_sync, transport=kind, bucket_mb=1)
            transports[mode, kind] = weight_sync.open_transport(ws, pools[mode])
    hf_config = AutoConfig.from_pretrained(model_dir)
    prompts = [[1, 5 + i, 9, 12 + 3 * i] for i in range(6)]
    result = {"layouts": {}, "versions_ok": True}
    try:
        if pools.get("inprocess") is not None:
            result["contract/inprocess"] = contract(pools["inprocess"], model_dir, logs)
        version = 0
        for tp, pp in [(2, 1), (1, 2), (2, 2)]:
            parallel.initialize(tp, pp, 0)
            tcfg = transformer_config(hf_config, tp, pp, torch.float32, False, "none", False)
            model, info = build_model(hf_config, tcfg, 128, "actor")
            load_hf_shard(model, info, HFCheckpoint(model_dir), "actor")
            actor = make_trainable(model, info, 1e-4, 0.0, 1.0, 0, 1)
            # noise seeded by the shard's position: TP shards differ, while tensors replicated
            # over TP (norms) and DP replicas stay identical, as training keeps them
            with torch.no_grad():
                for i, p in enumerate(source.unwrap(actor.model).parameters()):
                    split = getattr(p, "tensor_model_parallel", False)
                    seed = 10_000 * tp + 1000 * pp + 100 * i + 10 * parallel.pp_rank()
                    g = torch.Generator().manual_seed(seed + (parallel.tp_rank() if split else 0))
                    p.add_(0.05 * torch.randn(p.shape, generator=g))
            for kind in ("collective", "files"):
                with torch.no_grad():   # a different perturbation per transport
                    for p in source.unwrap(actor.model).parameters():
                        p.mul_(1.01)
                version += 1
                entry = {"version": version, "gaps": {}}
                if kind == "collective" and env.rank == 0:
                    os.chmod(staging, 0o500)      # the collective route must never stage a file
                before, seen = writes["n"], weight_files()
                # the last layout's collective push runs with a request in flight on each engine
                keep_check = (tp, pp, kind) == (2, 2, "collective")
                held = {} if keep_check and env.rank == 0 else None
                for mode, pool in pools.items():
                    if held is not None:
                        start_held(f"{mode}-wire", pool)    # generates through the staged wire
                        hold_at_the_swap(mode, pool, held)
                    sync = transports[mode, kind].push(actor.model, info, version)
                    gaps = weight_sync.engine_mismatch(actor, pool, prompts, 16, 1, TEMPERATURE)
                    entry["gaps"].update({f"{mode}/{k}": v for k, v in gaps.items()})
                    if pool is not None:
                        result["versions_ok"] &= pool.version == version
                if env.rank == 0:
                    os.chmod(staging, 0o700)
                if keep_check:
                    result["held_over_push"] = held_gaps(actor, info, held, version)
                entry["files_written"] = writes["n"] - before
                entry["new_weight_files"] = sorted(weight_files() - seen)
                entry["sync_bytes"] = sync["sync_bytes"]
                result["layouts"][f"tp{tp}pp{pp}/{kind}"] = entry
            if (tp, pp) in ((2, 1), (1, 2)):   # TP=2 and TP=1: the top-k / top-p parity
                result.setdefault("cut_gaps", {})[f"tp{tp}pp{pp}"] = cut_gaps(actor, info, pools, prompts)
            last = (actor, info)
        # a push that drops one bucket: the engines keep a stale tensor, the probe must see it
        actor, info = last
        with torch.no_grad():
            for p in source.unwrap(actor.model).parameters():
                p.mul_(1.3)
        real_buckets = source.buckets

        def lossy(named, size):  # small buckets, the second one never reaches the engines
            for k, b in enumerate(real_buckets(named, 64 << 10)):
                if k != 1:
                    yield b
        source.buckets = lossy
        real_groups = pieces.group_pieces

        def lossy_pieces(items, size):   # the sharded route's: each sender's second bucket is lost
            for k, g in enumerate(real_groups(items, 64 << 10)):
                if k != 1:
                    yield g
        pieces.group_pieces = lossy_pieces
        result["skipped_bucket_gaps"] = {}
        for kind in ("collective", "files"):
            with torch.no_grad():
                for p in source.unwrap(actor.model).parameters():
                    p.mul_(1.1)
            version += 1
            for mode, pool in pools.items():
                try:
                    transports[mode, kind].push(actor.model, info, version)
                except Exception as err:  # a loader that refuses a partial checkpoint also detects it
                    result[f"skipped_bucket_error/{mode}/{kind}"] = f"{type(err).__name__}: {err}"
                gaps = weight_sync.engine_mismatch(actor, pool, prompts, 16, 1, TEMPERATURE)
                result["skipped_bucket_gaps"].update({f"{mode}/{kind}/{k}": v for k, v in gaps.items()})
                try:
                    weight_sync.verify(actor, pool, prompts, 16, 1, TEMPERATURE)
                except weight_sync.WeightSyncError as err:
                    result[f"verify_message/{mode}/{kind}"] = str(err)
        for pool in pools.values():
            if pool is not None:
                result.setdefault("health", []).extend(h.__dict__ for h in pool.health())
        result["last_version"] = version
        source.buckets = real_buckets
    finally:
        close_all(transports, pools)
        parallel.destroy()
    if env.rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:6])
