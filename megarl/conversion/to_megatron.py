"""HF -> megatron dist checkpoint: one gloo rank per (tp, pp) position builds ITS GPTModel shard
and fills it from the HF files through `megarl.models.loading` (the trainer's own loader), then
saves it.

Layout of a converted megatron folder (OUT):
  metadata.json, common.pt, .metadata, __*.distcp   the torch_dist checkpoint of
                                   `{"model": GPTModel.sharded_state_dict()}`, the same "model"
                                   key layout as the trainer's `step_<N>/actor/` folders
  hf_config/                       config.json, generation_config.json and the tokenizer files
                                   (every tokenizer* / *.py file: auto_map may name local code)
  megarl_conversion.json           tp, pp, source, architecture, dtype, padded vocab

Peak memory per rank: its megatron shard (which must exist to be saved) + one parameter's TP
slice of the HF tensors (+ megatron's save clones tensors that are views: the gate and up
halves of every SwiGLU fc1; see bench/RESULTS.md).

The conversion always runs on the CPU (gloo, megatron's local layer spec, the CPU shim). The
checkpoint keys are the ones the trainer's own checkpoints have; megatron maps the local spec's
norm names onto Transformer Engine's fused ones (`linear_qkv.layer_norm_weight`), so a TE model
should load them too (not tested here: no GPU).
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

from megarl.config.schema import ModelConfig
from megarl.conversion.launch import init_world, launch
from megarl.conversion.output import copy_side_files, prepare_out
from megarl.formats.dist_reader import CONVERSION_JSON, HF_CONFIG_DIR
from megarl.formats.experts import num_experts
from megarl.formats.hf_reader import ConversionError, HFCheckpoint, check_hf_checkpoint, load_hf_config
from megarl.formats.mapping import mapping_for, padded_vocab_size

DEFAULT_DIVISIBLE_BY = ModelConfig().make_vocab_size_divisible_by  # the schema owns the default
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _model_dtype(hf: HFCheckpoint, requested: str) -> torch.dtype:
    if requested != "auto":
        return _DTYPES[requested]
    dtype = hf.meta("model.embed_tokens.weight").dtype if "model.embed_tokens.weight" in hf.files \
        else torch.float32
    if dtype not in (torch.float32, torch.bfloat16):
        raise ConversionError(f"HF weights are {dtype}; megarl models are float32 or bfloat16: "
                              f"pass --dtype float32 or --dtype bfloat16")
    return dtype


def _hf_to_megatron_rank(rank: int, world: int, port: int, threads: int, hf_dir: str, out: str,
                         tp: int, pp: int, dtype_name: str, divisible_by: int,
                         progress: bool, ep: int = 1) -> None:
    """One gloo rank: build this (tp, pp, ep) position's GPTModel, fill it from the HF files, save."""
    init_world(rank, world, port, threads)
    # megatron, and the megarl modules that import it, inside functions: the CLI
    # (conversion.cli._run_cli) hides the GPUs before megatron reads torch.cuda at import
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from tqdm import tqdm

    from megarl.distributed import parallel
    from megarl.models.builders import build_model
    from megarl.models.loading import load_hf_shard
    from megarl.models.transformer_config import transformer_config

    parallel.initialize(tp, pp, seed=0, ep=ep)
    hf_config = load_hf_config(hf_dir)
    cfg = transformer_config(hf_config, tp, pp, _DTYPES[dtype_name], on_gpu=False, ep=ep)
    cfg.perform_initialization = False  # every parameter is overwritten below
    model, info = build_model(hf_config, cfg, divisible_by, "actor")
    # the trainer's loader: this rank reads only its TP slices of its PP stage's tensors
    bar = lambda names: tqdm(names, desc=f"HF -> megatron (rank {rank}/{world})",  # noqa: E731
                             unit="tensor", disable=not progress or rank != 0, file=sys.stderr)
    load_hf_shard(model, info, HFCheckpoint(hf_dir), "actor",
                  mapping_for(hf_config, te_names=False), progress=bar)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict()}, out)
    dist.barrier()
    parallel.destroy()
    dist.destroy_process_group()


def hf_to_megatron(hf_dir: str, out: str, tp: int = 1, pp: int = 1, dtype: str = "auto",
                   divisible_by: int = DEFAULT_DIVISIBLE_BY, force: bool = False,
                   progress: bool = True, ep: int = 1) -> dict:
    """Convert an HF folder into a megatron dist checkpoint at TP x PP (x EP for an MoE model:
    each rank saves only its experts; launches tp*pp*ep ranks).

    Returns the megarl_conversion.json record.
    """
    if tp < 1 or pp < 1 or ep < 1:
        raise ConversionError(f"--tp, --pp and --ep must be >= 1, got tp={tp}, pp={pp}, ep={ep}")
    hf = HFCheckpoint(hf_dir)
    hf_config = load_hf_config(hf_dir)
    from megarl.models.transformer_config import transformer_config  # imports megatron: see _hf_to_megatron_rank
    mapping = mapping_for(hf_config)
    model_dtype = _model_dtype(hf, dtype)
    dtype_name = str(model_dtype).removeprefix("torch.")
    experts = num_experts(hf_config)
    if experts % ep:   # named as the converter's flag (transformer_config names the trainer's setting)
        raise ConversionError(f"--ep {ep} must divide the model's {experts} experts (num_experts in "
                              f"{hf_dir}/config.json): each rank writes num_experts / ep of them; pick a "
                              f"divisor of {experts}" if experts else
                              f"--ep {ep}: {hf_dir} holds a dense model (no experts): leave --ep at 1")
    transformer_config(hf_config, tp, pp, model_dtype, on_gpu=False, ep=ep)  # TP/PP vs the model
    check_hf_checkpoint(hf, mapping)
    hf.close()

    out_path = prepare_out(out, force)

    world = tp * pp * ep
    threads = max(1, (os.cpu_count() or 1) // world)
    args = (str(hf_dir), str(out_path), tp, pp, dtype_name,
            divisible_by, progress, ep)
    t0 = time.perf_counter()
    launch(_hf_to_megatron_rank, world, threads, args, "convert_hf_to_megatron")
    record = {
        "format": "megatron-core torch_dist", "key": "model",
        "tp": tp, "pp": pp, "ep": ep, "source": str(Path(hf_dir).resolve()),
        "architecture": mapping.arch, "dtype": dtype_name,
        "vocab_size": mapping.dims.vocab, "make_vocab_size_divisible_by": divisible_by,
        "padded_vocab_size": padded_vocab_size(mapping.dims.vocab, divisible_by, tp),
        "num_layers": mapping.dims.num_layers, "tied_embeddings": mapping.dims.tied,
        "megatron_core": _mcore_version(),
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    record["hf_files"] = copy_side_files(Path(hf_dir), out_path / HF_CONFIG_DIR)
    (out_path / CONVERSION_JSON).write_text(json.dumps(record, indent=2) + "\n")
    return record


def _mcore_version() -> str:
    try:
        from importlib.metadata import version
        return version("megatron-core")
    except Exception:  # noqa: BLE001
        return "unknown"
