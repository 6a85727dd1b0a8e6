"""`megarl eval RECIPE (--model HF_DIR | --run RUN_DIR [--step N]) --out DIR`: the recipe's
held-out evaluation (eval.*) of a model, without training (docs/evaluation.md "Without training").

The model is an HF folder, or a run's checkpoint exported to `<out>/model` as `megarl export`
does (the actor's weights after that many steps; a LoRA run's: the merged full model, `--merged`).
The engines of rollout.engines.* start on it,
`eval/runner.Evaluator` runs once at version V (0 for --model; K + 1 for checkpoint step_K, which
holds the weights after step K, the ones the run evaluates as version K + 1), and its row goes to
`<out>/metrics.jsonl` at step V, its dumps to `<out>/eval/<dataset>/step_<V>.jsonl`: the same
metrics and dumps as the in-run evaluation of that version, for the same recipe and seed.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path


def input_problem(cfg, model: str | None, run: str | None, step: int | None, out: str) -> str | None:
    """The one line that refuses the command's inputs before anything starts, or None."""
    if bool(model) == bool(run):
        return "give the model to score: --model HF_DIR (a Hugging Face folder) or --run RUN_DIR [--step N]"
    if model and step is not None:
        return "--step picks a checkpoint of --run RUN_DIR; an HF folder (--model) is scored as version 0"
    if model and not (Path(model) / "config.json").is_file():
        return f"--model {model!r}: no config.json there (a Hugging Face folder is needed)"
    if run and not Path(run).is_dir():
        return f"--run {run!r}: no such folder (a run's run.dir, or a checkpoint.dir)"
    if cfg.rollout.engines.mode == "remote":   # it would score whatever weights a run last pushed there
        return ("rollout.engines.mode=remote: megarl eval starts its engines on the model it scores, and remote "
                "servers hold the weights they were last given; use rollout.engines.mode=local_servers or inprocess")
    if not cfg.eval.datasets:
        return "the recipe lists no eval.datasets: give them, e.g. eval.datasets=[data/held.jsonl]"
    if (Path(out) / "metrics.jsonl").exists():
        return f"--out {out!r} holds a metrics.jsonl already: choose a new folder"
    return None


def checkpoint_model(run: str, step: int | None, out: str, progress: bool = True) -> tuple[str, int]:
    """The HF model folder (written under `<out>/model`) of `run`'s checkpoint step_<step> (the
    newest when None), and the weight version it holds."""
    from megarl.checkpoint.hf_export import export_checkpoint, pick_checkpoint
    from megarl.checkpoint.peft_export import MERGED, is_lora_checkpoint
    checkpoint = pick_checkpoint(run, step)
    saved = int(checkpoint.name.removeprefix("step_"))
    # a LoRA run's checkpoint holds adapters only: its export is a PEFT adapter folder, which the
    # engines cannot open as a model, so the merged full model written beside it is scored
    lora = is_lora_checkpoint(checkpoint / "actor")
    model = export_checkpoint(run, saved, os.path.join(out, "model"), force=True, progress=progress, merged=lora)
    # checkpoint step_K holds the weights after step K: version K + 1
    return str(model / MERGED if lora else model), saved + 1


def evaluate(cfg, model: str | None, run: str | None, step: int | None, out: str, progress: bool = True) -> dict:
    """Score `cfg`'s eval.datasets on the model (module docstring); the evaluation's metrics."""
    from megarl import preflight
    from megarl.eval.datasets import load_eval_sets
    from megarl.eval.runner import Evaluator
    from megarl.metrics.logger import MetricsLogger
    from megarl.rollout.engines.pool import open_pool
    os.makedirs(out, exist_ok=True)
    version = 0
    if run:
        model, version = checkpoint_model(run, step, out, progress)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model)),
                              run=dataclasses.replace(cfg.run, dir=str(out)))
    sets = load_eval_sets(cfg)
    tokenizer = preflight.load_tokenizer(cfg.model.path)
    pool = open_pool(cfg.rollout, cfg.model.path, cfg.run.seed, os.path.join(out, "engines"))
    for engine in pool.pool.engines:   # they loaded version `version` from files: their tokens say so
        engine.version = version
    logger = MetricsLogger(out, max(version, 1), cfg.metrics.tensorboard, cfg.metrics.progress)
    try:
        return Evaluator(cfg, sets, pool, tokenizer, logger).run(version)
    finally:
        logger.close()
        pool.close()


def main(cfg, args) -> int:
    """`megarl eval` of parsed `args` (after the CLI's bootstrap); a bad input is one line on
    stderr and exit 2, the CLI explains the errors of the run itself."""
    import sys
    problem = input_problem(cfg, args.model, args.run, args.step, args.out)
    if problem:
        print(f"megarl eval: error: {problem}", file=sys.stderr)
        return 2
    metrics = evaluate(cfg, args.model, args.run, args.step, args.out)
    print(f"wrote {Path(args.out) / 'metrics.jsonl'} ({len(metrics)} figures)")
    return 0


def add_parser(sub) -> None:
    ev = sub.add_parser("eval", help="score a model on the recipe's eval.datasets, without training "
                                     "(docs/evaluation.md)")
    ev.add_argument("recipe")
    ev.add_argument("overrides", nargs="*")
    ev.add_argument("--model", default=None, help="a Hugging Face folder to score (version 0)")
    ev.add_argument("--run", default=None, help="a run's run.dir (or checkpoint.dir): score its checkpoint")
    ev.add_argument("--step", type=int, default=None, help="with --run: checkpoint step_<N> (default: the newest), "
                    "scored as version N + 1 (the weights after step N)")
    ev.add_argument("--out", required=True, help="output folder: metrics.jsonl, eval/<dataset>/step_<N>.jsonl, "
                                                 "engines/, model/ (--run)")

