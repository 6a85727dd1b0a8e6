"""`megarl export RUN_DIR [--step N] --out DIR [--merged]`: a saved checkpoint's actor as an HF
folder; a LoRA run's as a PEFT adapter folder, with --merged also the merged full model.

Light until it runs: the CLI imports it before the CPU shim; `main` hides the GPUs (the
conversion is a CPU job), applies the shim, then imports the converters (checkpoint/hf_export.py).
"""
from __future__ import annotations

import os
import sys
import time


def add_parser(sub) -> None:
    ex = sub.add_parser("export", help="a saved checkpoint's actor as a Hugging Face folder "
                                       "(README.md: Hugging Face exports)")
    ex.add_argument("run_dir", help="the run's run.dir (its checkpoints/ folder), or a checkpoint.dir")
    ex.add_argument("--step", type=int, default=None, help="checkpoint step_<N> (default: the newest complete one)")
    ex.add_argument("--out", required=True, help="new output folder (config.json, safetensors shards, tokenizer)")
    ex.add_argument("--shard-mb", type=float, default=2048, help="safetensors shard size in MiB")
    ex.add_argument("--hf-config", default=None,
                    help="folder with config.json + tokenizer (default: model.path of the checkpoint's config.yaml)")
    ex.add_argument("--force", action="store_true", help="replace an existing --out")
    ex.add_argument("--merged", action="store_true",
                    help="a LoRA run: also the merged full model (W + alpha/r B A) in <out>/merged, beside "
                         "the PEFT adapter folder (docs/lora.md)")
    ex.add_argument("--no-progress", action="store_true")


def main(args) -> int:
    """Run the export of parsed `args`; a user error is one line on stderr and exit code 2."""
    problem = input_problem(args.run_dir, args.out, args.force)
    if problem:   # before the seconds of imports below
        print(f"megarl export: error: {problem}", file=sys.stderr)
        return 2
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from megarl.bootstrap import bootstrap
    bootstrap()
    import warnings
    for category in (UserWarning, FutureWarning, DeprecationWarning):   # megatron's "Apex is not installed"
        warnings.filterwarnings("ignore", category=category)            # and the like: nothing to act on
    from megarl.checkpoint.hf_export import export_checkpoint
    from megarl.formats.hf_reader import ConversionError
    t0 = time.perf_counter()
    try:
        out = export_checkpoint(args.run_dir, args.step, args.out, args.shard_mb, args.hf_config,
                                args.force, not args.no_progress, args.merged)
    except (ConversionError, ValueError, FileNotFoundError) as err:
        print(f"megarl export: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({time.perf_counter() - t0:.1f} s)")
    return 0


def input_problem(run_dir: str, out: str, force: bool) -> str | None:
    """What is wrong with the command's paths, judged without importing anything heavy."""
    if not os.path.isdir(run_dir):
        return f"run directory {run_dir!r} does not exist"
    if os.path.exists(out) and not force and not (os.path.isdir(out) and not os.listdir(out)):
        return f"--out {out!r} already exists: choose a new folder, or pass --force to replace it"
    return None
