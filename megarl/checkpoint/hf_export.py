"""Hugging Face exports of the actor: `<run.dir>/hf/step_<N>` every checkpoint.hf_every steps,
`<run.dir>/hf/final` after the run's last step, and `megarl export` from a saved checkpoint.

An export folder holds `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`, and
model.path's config.json (its dtype set to the weights'), generation_config.json (made from the
config when model.path has none) and tokenizer files, and `megarl_export.json` (step, layout).
It loads in transformers (`from_pretrained`) and vLLM (`LLM(model=...)`) as the trainer's actor.

Streaming: during a run each PP stage's TP ranks gather one parameter at a time through the
weight push's own path (`rollout/weights/source.hf_tensors`: the same mapping tables, fused QKV
and fc1 split, vocab padding removed), and the stage's first TP rank of DP replica 0 writes
them as safetensors shards of about checkpoint.hf_shard_mb: no rank holds more than one shard's
tensors, and every stage writes its own files (run.dir is on a file system every rank sees, as
for checkpoints). From a saved checkpoint, `conversion.to_hf.megatron_to_hf` reads it one
layer at a time in one process.

Atomic: an export is written into `.tmp_<name>` beside its final folder, every file fsynced,
then renamed onto the final name (an existing folder of that name is exchanged with it in one
step where the kernel can, `_publish`): a crash at any moment leaves the previous folder of
that name intact and no partial folder under the final name; the next export removes the
stale `.tmp_` folder.
"""
from __future__ import annotations

import ctypes
import datetime
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megarl.checkpoint import CheckpointError
from megarl.conversion.output import copy_side_files
from megarl.distributed import parallel
from megarl.distributed.env import from_rank0
from megarl.formats.hf_reader import INDEX_JSON, ST_TO_TORCH
from megarl.rollout.weights import source

TMP_PREFIX = ".tmp_"
RECORD_JSON = "megarl_export.json"
FINAL = "final"


def export_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "hf"


def after_step(cfg, step: int, actor) -> list[Path]:
    """Collective, after step `step` (every rank): the actor into `<run.dir>/hf/step_<step>` when
    checkpoint.hf_every divides step + 1 (as checkpoint.every counts), and into
    `<run.dir>/hf/final` after the run's last step (train.steps - 1) with checkpoint.hf_final.
    Returns the folders written."""
    ck = cfg.checkpoint
    scheduled = bool(ck.hf_every) and (step + 1) % ck.hf_every == 0
    final = ck.hf_final and step + 1 == cfg.train.steps
    written: list[Path] = []
    root = export_root(cfg.run.dir)
    if scheduled:
        written.append(export_actor(actor.model, actor.info, root / f"step_{step}", cfg.model.path,
                                    ck.hf_shard_mb, step))
    if final and scheduled:   # the same weights: hard links to the step's files, not a second gather
        written.append(_copy_export(written[0], root / FINAL))
    elif final:
        written.append(export_actor(actor.model, actor.info, root / FINAL, cfg.model.path,
                                    ck.hf_shard_mb, step))
    return written


def export_actor(model, info, out: str | os.PathLike, side_dir: str | os.PathLike, shard_mb: int,
                 step: int | None = None) -> Path:
    """Collective over every trainer rank: `model` (the actor, any TP x PP x DP) as an HF folder
    `out`, its config and tokenizer from `side_dir` (model.path). Raises CheckpointError on
    every rank, with no partial folder left and a previous `out` intact, when it cannot be
    written (disk full, permissions)."""
    t0 = time.perf_counter()
    out = Path(out)
    tmp = out.parent / f"{TMP_PREFIX}{out.name}"
    problem = None
    if _is_rank0():
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as err:
            problem = f"cannot create {tmp}: {err}"
    problem = from_rank0(problem)
    if problem is None:
        files, error = _write_stage(model, info, tmp, max(1, shard_mb) << 20)
        gathered = _gather(((parallel.pp_rank(), files), error))
        record = {"step": step, "tp": parallel.tp_size(), "pp": parallel.pp_size()}
        problem = _finish(tmp, out, gathered, side_dir, record) if _is_rank0() else None
        problem = from_rank0(problem)
    if problem:
        raise CheckpointError(f"HF export {out} could not be written: {problem}; nothing partial is left "
                              f"under that name (a previous export there is intact)")
    if _is_rank0():
        print(f"megarl: exported the actor{'' if step is None else f' of step {step}'} to {out} "
              f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    return out


def _write_stage(model, info, tmp: Path, shard_bytes: int) -> tuple[list, str | None]:
    """This stage's HF tensors, TP-gathered (and EP-gathered) one parameter at a time; its first
    TP rank of DP replica 0 writes them as `stage<pp>-<k>.safetensors` of about `shard_bytes` each. Returns
    [(file, names, bytes)] and the error that stopped the writes (None). A write error does not
    stop the iteration: the stage's other TP ranks are gathering in lockstep with this one."""
    if not source.joins_gathers():
        return [], None
    files: list = []
    error = None
    try:
        named = source.hf_tensors(model, info)
        # with expert parallelism the other ranks of DP replica 0's expert groups hold the other
        # experts: they join the gathers (without them replica 0 would wait forever) but write nothing
        if parallel.tp_rank() != 0 or parallel.dp_rank() != 0:
            for _ in named:      # only the gathers
                pass
            return [], None
        # each tensor to the host as it comes: a shard waits in host memory, not the GPU's
        on_host = ((n, _owned(t)) for n, t in named)
        for k, host in enumerate(source.buckets(on_host, shard_bytes)):
            if error is not None:
                continue
            name = f"stage{parallel.pp_rank():03d}-{k:05d}.safetensors"
            try:
                save_file(host, str(tmp / name), metadata={"format": "pt"})
                _fsync(tmp / name)
                files.append((name, list(host), sum(t.numel() * t.element_size() for t in host.values())))
            except OSError as err:
                error = f"stage {parallel.pp_rank()}: {err}"
    except Exception as err:  # noqa: BLE001 - a mapping error: the same on the stage's TP ranks
        error = f"stage {parallel.pp_rank()}: {type(err).__name__}: {err}"
    return files, error


def _owned(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host in storage of its own (safetensors refuses tensors that share memory:
    q, k and v split from one fused tensor may)."""
    t = t.detach().cpu()
    if t._base is not None or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t.contiguous()


def _gather(obj) -> list:
    """Every rank's `obj` on global rank 0 (None elsewhere); [obj] without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _finish(tmp: Path, out: Path, gathered: list, side_dir, record: dict) -> str | None:
    """Rank 0: name the shards, write the index and side files, fsync, publish. Returns the
    problem (None when `out` is in place); the temporary folder is removed on a problem."""
    errors = [e for _, e in gathered if e]
    if not errors:
        try:
            shards = [f for _, f in sorted((stage, f) for (stage, files), _ in gathered for f in files)]
            write_index(tmp, shards)
            dtype = _dtype_of(tmp, "model-00001-of-" + f"{len(shards):05d}.safetensors") if shards else None
            finish_side_files(tmp, Path(side_dir), dtype, record)
            publish(tmp, out)
            return None
        except OSError as err:
            errors.append(str(err))
    shutil.rmtree(tmp, ignore_errors=True)
    return "; ".join(errors)


def write_index(folder: Path, shards: list[tuple[str, list[str], int]]) -> None:
    """Rename the (file, tensor names, bytes) shards, in order, to HF's
    model-0000k-of-0000n.safetensors and write the index json naming every tensor's file."""
    weight_map, nbytes = {}, 0
    for i, (name, names, size) in enumerate(shards):
        final_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(folder / name, folder / final_name)
        weight_map.update({n: final_name for n in names})
        nbytes += size
    index = {"metadata": {"total_size": nbytes}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_JSON).write_text(json.dumps(index, indent=2) + "\n")


def _dtype_of(folder: Path, shard: str) -> str:
    from safetensors import safe_open
    with safe_open(str(folder / shard), framework="pt") as f:
        return str(f.get_slice(next(iter(f.keys()))).get_dtype())


# safetensors dtype name -> config.json's ("BF16" -> "bfloat16")
_ST_DTYPE_NAMES = {st: str(t).removeprefix("torch.") for st, t in ST_TO_TORCH.items()}


def finish_side_files(folder: Path, side_dir: Path, st_dtype: str | None, record: dict) -> None:
    """config.json, tokenizer and generation config from `side_dir` into `folder` (config.json's
    dtype set to the exported weights', `st_dtype` a safetensors dtype name; a generation
    config made from config.json when `side_dir` has none), and the export record."""
    copied = copy_side_files(side_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    dtype = _ST_DTYPE_NAMES.get(st_dtype or "", None)
    if dtype:   # transformers >= 5 reads "dtype", older ones "torch_dtype"
        config["dtype"] = dtype
        if "torch_dtype" in config:
            config["torch_dtype"] = dtype
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if not (folder / "generation_config.json").is_file():
        from transformers import GenerationConfig, PretrainedConfig
        GenerationConfig.from_model_config(PretrainedConfig.from_dict(config)).save_pretrained(str(folder))
    (folder / RECORD_JSON).write_text(json.dumps({
        **record, "source": str(Path(side_dir).resolve()), "side_files": copied, "dtype": dtype,
        "created": datetime.datetime.now().isoformat(timespec="seconds")}, indent=2) + "\n")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, out: Path) -> None:
    """Make the finished folder `tmp` appear as `out`, durably: its files and itself fsynced,
    then renamed. An existing `out` is exchanged with `tmp` in one step (renameat2
    RENAME_EXCHANGE) and then removed; where the file system cannot exchange, it is renamed
    aside first (a crash between the two renames leaves it complete, as `.old_<name>`)."""
    mode = _file_mode()
    for f in tmp.rglob("*"):
        if f.is_file():
            os.chmod(f, mode)   # safetensors writes 0600: readable as any file this process writes
            _fsync(f)
    _fsync(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists():
        os.rename(tmp, out)
    elif _exchange(tmp, out):
        shutil.rmtree(tmp)          # now the previous export
    else:
        old = out.parent / f".old_{out.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    _fsync(out.parent)


def _file_mode() -> int:
    """The mode `open()` gives a new file here (0644 under the usual umask 022). The umask is
    read from /proc: setting it to read it back would race the run's other threads."""
    try:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("Umask:"))
        umask = int(line.split()[1], 8)
    except (OSError, StopIteration, ValueError, IndexError):
        umask = 0o022
    return 0o666 & ~umask


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _copy_export(src: Path, out: Path) -> Path:
    """Collective: the export `src` published again as `out` (hard links where the file
    system allows: the files are never written again)."""
    problem = None
    if _is_rank0():
        tmp = out.parent / f"{TMP_PREFIX}{out.name}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(src, tmp, copy_function=_link_or_copy)
            publish(tmp, out)
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            problem = f"HF export {out} could not be written: {err}; a previous export there is intact"
    problem = from_rank0(problem)
    if problem:
        raise CheckpointError(problem)
    return out


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


# ---- `megarl export`: from a saved checkpoint ------------------------------------------------

def checkpoint_root(run_dir: Path) -> Path:
    """Where a run's step_<N>/ folders are: <run_dir>/checkpoints, else checkpoint.dir of the
    run's config.yaml, else run_dir itself (a checkpoint.dir given as RUN_DIR)."""
    if (run_dir / "checkpoints").is_dir():
        return run_dir / "checkpoints"
    config = run_dir / "config.yaml"
    if config.is_file():
        from omegaconf import OmegaConf
        where = OmegaConf.select(OmegaConf.load(config), "checkpoint.dir", default="")
        if where:
            return Path(where)
    return run_dir


def pick_checkpoint(run_dir: str | os.PathLike, step: int | None) -> Path:
    """The complete checkpoint step_<step> of the run, or its newest intact one (step None);
    ConversionError naming what is there otherwise."""
    from megarl.checkpoint import manager
    from megarl.config import ConfigError
    from megarl.formats.hf_reader import ConversionError
    run = Path(run_dir)
    if not run.is_dir():
        raise ConversionError(f"run directory {str(run_dir)!r} does not exist")
    root = checkpoint_root(run)
    done = manager.complete_checkpoints(root)
    names = ", ".join(p.name for p in done[-6:]) or "none"
    if step is None:
        try:
            path = manager.resume_point(root)
        except ConfigError as err:
            raise ConversionError(str(err)) from None
        if path is None:
            raise ConversionError(f"no complete checkpoint under {str(root)!r}: a run writes one every "
                                  f"checkpoint.every steps and at its end")
        return path
    path = root / f"step_{step}"
    if path not in done:
        raise ConversionError(f"--step {step}: no complete checkpoint {str(path)!r} (complete ones: {names})")
    problem = manager.checkpoint_problem(path)
    if problem:
        raise ConversionError(f"--step {step}: checkpoint {str(path)!r} is damaged ({problem}); "
                              f"pick another --step (complete ones: {names})")
    return path


def side_dir_of(checkpoint: Path, hf_config: str | None) -> Path:
    """Where the export's config.json and tokenizer come from: --hf-config, else model.path of
    the checkpoint's config.yaml."""
    from megarl.formats.hf_reader import ConversionError
    if hf_config:
        side, what = Path(hf_config), "--hf-config"
    else:
        from omegaconf import OmegaConf
        side = Path(OmegaConf.select(OmegaConf.load(checkpoint / "config.yaml"), "model.path"))
        what = f"model.path={str(side)!r} of {checkpoint / 'config.yaml'}"
    if not (side / "config.json").is_file():
        raise ConversionError(f"{what}: no config.json there; pass --hf-config with the model's folder "
                              f"(config.json and tokenizer files)")
    return side


def export_checkpoint(run_dir: str, step: int | None, out: str, shard_mb: float = 2048,
                      hf_config: str | None = None, force: bool = False, progress: bool = True,
                      merged: bool = False) -> Path:
    """`megarl export`: the actor of a saved checkpoint (any TP x PP) as an HF folder `out`,
    read one layer at a time, written atomically like the run's own exports. A LoRA run's
    checkpoint (adapters only) becomes a PEFT adapter folder, and with `merged` also the merged
    full model in `out/merged` (checkpoint/peft_export.py)."""
    from megarl.checkpoint import peft_export
    from megarl.conversion.to_hf import megatron_to_hf
    from megarl.formats.hf_reader import ConversionError
    dest = Path(out)
    if dest.exists() and not (dest.is_dir() and not any(dest.iterdir())) and not force:
        raise ConversionError(f"--out {out!r} already exists: choose a new folder, or pass --force to replace it")
    checkpoint = pick_checkpoint(run_dir, step)
    side = side_dir_of(checkpoint, hf_config)
    tmp = dest.parent / f"{TMP_PREFIX}{dest.name}"
    lora = peft_export.is_lora_checkpoint(checkpoint / "actor")
    if merged and not lora:
        raise ConversionError(f"--merged: {checkpoint} is not a LoRA run's (its actor holds the full weights, "
                              f"which the export writes as they are): leave --merged out")
    try:
        if lora:
            shutil.rmtree(tmp, ignore_errors=True)
            peft_export.export_peft(checkpoint, side, tmp, merged)
            publish(tmp, dest)
            return dest
        index = megatron_to_hf(str(checkpoint / "actor"), str(tmp), shard_mb, str(side), True, progress)
        first = sorted(set(index["weight_map"].values()))[0]
        finish_side_files(tmp, side, _dtype_of(tmp, first),
                          {"step": int(checkpoint.name.removeprefix("step_")),
                           "checkpoint": str(checkpoint.resolve())})
        publish(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
