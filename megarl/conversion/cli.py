"""The conversion CLIs behind tools/convert_hf_to_megatron.py, tools/convert_megatron_to_hf.py
and tools/compare_logits.py: argument parsing and one-line errors (exit 2) for user mistakes
(`ConversionError` or the mapping's `ValueError`)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterable

from megarl.bootstrap import bootstrap
from megarl.conversion.compare import compare_logits
from megarl.conversion.to_hf import megatron_to_hf
from megarl.conversion.to_megatron import DEFAULT_DIVISIBLE_BY, hf_to_megatron
from megarl.formats.hf_reader import ConversionError


def _return_freed_memory(threshold: int = 1 << 20) -> None:
    """Have glibc give tensor-sized blocks back to the OS when they are freed.

    glibc raises its mmap threshold to the size of the largest block freed so far (up to 32
    MiB), after which tensors come from the heap and freed ones stay resident: a converter
    that handles one parameter at a time would still grow towards the model size. A fixed
    threshold keeps each tensor in its own mapping, unmapped when freed. No-op off glibc.
    """
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD (also disables the dynamic threshold)
    except (OSError, AttributeError):
        pass


def _run_cli(prog: str, fn, argv: Iterable[str] | None) -> int:
    """Run fn(argv); user errors become one line on stderr and exit code 2.

    Conversion is a CPU job (see the module docstring): the GPUs are hidden from this process
    (CUDA reads the variable when it is first touched, which has not happened yet)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    bootstrap()   # after the GPUs are hidden: the CPU shim, before the converters import megatron
    _return_freed_memory()
    import warnings
    for category in (UserWarning, FutureWarning, DeprecationWarning):  # megatron's "Apex is not
        warnings.filterwarnings("ignore", category=category)          # installed" x7 and the like
    try:
        return fn(argv) or 0
    except (ConversionError, ValueError, FileNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def cli_hf_to_megatron(argv=None) -> int:
    p = argparse.ArgumentParser(prog="convert_hf_to_megatron",
                                description="HF safetensors folder -> megatron dist checkpoint")
    p.add_argument("--hf", required=True, help="HF model folder (config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="output folder for the dist checkpoint")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="parameter dtype (auto: the HF embedding's)")
    p.add_argument("--vocab-divisible-by", type=int, default=DEFAULT_DIVISIBLE_BY,
                   help="megatron pads the vocab to a multiple of this x TP (the trainer's "
                        "model.make_vocab_size_divisible_by)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--no-progress", action="store_true")

    def run(argv):
        a = p.parse_args(argv)
        rec = hf_to_megatron(a.hf, a.out, a.tp, a.pp, a.dtype, a.vocab_divisible_by, a.force,
                             not a.no_progress, a.ep)
        print(f"wrote {a.out}: {rec['architecture']} tp={rec['tp']} pp={rec['pp']} ep={rec['ep']} "
              f"dtype={rec['dtype']} padded_vocab={rec['padded_vocab_size']} "
              f"({rec['seconds']} s)")
    return _run_cli("convert_hf_to_megatron", run, argv)


def cli_megatron_to_hf(argv=None) -> int:
    p = argparse.ArgumentParser(prog="convert_megatron_to_hf",
                                description="megatron dist checkpoint -> HF safetensors folder")
    p.add_argument("--megatron", required=True, help="dist checkpoint folder (any TP x PP)")
    p.add_argument("--out", required=True, help="output HF folder")
    p.add_argument("--shard-mb", type=float, default=500,
                   help="safetensors shard size in MiB (a larger tensor gets a shard of its own)")
    p.add_argument("--hf-config", default=None,
                   help="folder with config.json + tokenizer (default: <megatron>/hf_config)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--no-progress", action="store_true")

    def run(argv):
        a = p.parse_args(argv)
        t0 = time.perf_counter()
        index = megatron_to_hf(a.megatron, a.out, a.shard_mb, a.hf_config, a.force, not a.no_progress)
        files = len(set(index["weight_map"].values()))
        print(f"wrote {a.out}: {len(index['weight_map'])} tensors, "
              f"{index['metadata']['total_size'] / 2**20:.1f} MiB in {files} shard(s) "
              f"({time.perf_counter() - t0:.1f} s)")
    return _run_cli("convert_megatron_to_hf", run, argv)


def cli_compare_logits(argv=None) -> int:
    p = argparse.ArgumentParser(prog="compare_logits",
                                description="transformers vs megarl/megatron logits on random prompts")
    p.add_argument("--hf", required=True, help="HF model folder")
    p.add_argument("--megatron", required=True, help="megatron dist checkpoint folder")
    p.add_argument("--prompts", type=int, default=4, help="number of random prompts")
    p.add_argument("--length", type=int, default=32, help="tokens per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-4, help="max abs logit difference allowed")
    p.add_argument("--hf-config", default=None, help="config for the megatron side (default: "
                                                     "<megatron>/hf_config)")
    p.add_argument("--json", default=None, help="also write the numbers to this file")

    def run(argv):
        a = p.parse_args(argv)
        s = compare_logits(a.hf, a.megatron, a.prompts, a.length, a.seed, a.hf_config)
        s["tol"] = a.tol
        s["ok"] = s["max_abs_diff"] <= a.tol
        print(f"prompts={a.prompts} x {a.length} tokens  argmax_agreement={s['argmax_agreement']:.4f}  "
              f"max_abs_diff={s['max_abs_diff']:.3e}  mean_abs_diff={s['mean_abs_diff']:.3e}  "
              f"KL(hf||megatron)={s['kl_hf_megatron']:.3e}")
        if a.json:
            Path(a.json).write_text(json.dumps(s, indent=2) + "\n")
        if not s["ok"]:
            print(f"compare_logits: FAIL: max abs logit difference {s['max_abs_diff']:.3e} exceeds "
                  f"--tol {a.tol:g}: the converted model does not reproduce the HF model",
                  file=sys.stderr)
            return 1
        print(f"compare_logits: OK (max abs diff <= {a.tol:g})")
        return 0
    return _run_cli("compare_logits", run, argv)
