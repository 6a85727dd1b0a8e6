"""Checkpoints: megatron dist checkpoints (actor, critic, optimizers) + the driver's state.

Layout of `<dir>/step_<N>/`:
  actor/, critic/      megatron dist checkpoints (model + distributed optimizer + LR schedule),
                       fully reshardable: a run may resume at another TP x PP x DP. With LoRA
                       (model.lora) the trained tensors only (adapters; a LoRA critic's value head)
                       and base.json naming the base: its frozen weights load from model.path
  driver.pt            step, weight version, and the state of every component registered in
                       a `StateRegistry` (checkpoint/state.py: data cursor "sampler", RNG
                       states "rng", the driver's carry "rollout"), under its name (rank 0 writes)
  config.yaml          the resolved config of the run that wrote it
  COMPLETE             written last; a folder without it is ignored
A save goes to `tmp_step_<N>` and is renamed when every rank has finished, so a crash at any
moment leaves the previous checkpoint intact. Only the newest `keep` are kept.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint import FileSystemReader

from megarl.checkpoint import CheckpointError
from megarl.checkpoint.optimizer_layout import OPTIMIZER_METADATA, to_this_layout
from megarl.checkpoint.state import StateRegistry, rng_state, set_rng_state  # noqa: F401 - rng_*: public here
from megarl.config.errors import ConfigError
from megarl.distributed import faults
from megarl.distributed.env import from_rank0
from megarl.models.builders import Trainable

_STEP = re.compile(r"^step_(\d+)$")
#: in a model folder of a LoRA run: the base the adapters were trained on (the weights are not saved)
BASE_FILE = "base.json"


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Finished checkpoints under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP.match(p.name)) and (p / "COMPLETE").exists()]
    return [p for _, p in sorted(found)]


def checkpoint_problem(path: str | Path) -> str | None:
    """Why a complete checkpoint (COMPLETE written) cannot be resumed from, judged from its files
    alone: driver.pt loads, and each model folder has its metadata and every shard file its
    metadata points into, at least as long as the data it locates there (None when intact).
    A folder damaged after its save (a shard deleted, a copy cut short) is found here, before
    any rank starts loading it."""
    path = Path(path)
    for model in ("actor", "critic"):
        folder = path / model
        if model == "critic" and not folder.exists():
            continue   # written without a critic (grpo): load() names a mismatch with algo.name
        for name in ("metadata.json", "scheduler.pt"):
            if not (folder / name).is_file():
                return f"{model}/{name} is missing"
        problem = dist_folder_problem(folder)
        if problem:
            return f"{model}/{problem}"
    try:
        torch.load(path / "driver.pt", weights_only=True)
    except FileNotFoundError:
        return "driver.pt is missing"
    except Exception as err:   # noqa: BLE001 - a truncated zip, a foreign file
        return f"driver.pt does not load ({type(err).__name__})"
    return None


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def dist_folder_problem(folder: str | Path) -> str | None:
    """Why a torch_dist checkpoint folder (megatron's dist_checkpointing format) is incomplete,
    from its files alone: `.metadata` loads, and every shard file it points into is there and
    at least as long as the data it locates there (None when complete). Names are relative
    to the folder."""
    folder = Path(folder)
    if not (folder / ".metadata").is_file():
        return ".metadata is missing"
    try:
        storage = FileSystemReader(str(folder)).read_metadata().storage_data
    except Exception as err:   # noqa: BLE001 - a truncated or foreign .metadata (pickle)
        return f".metadata does not load ({type(err).__name__})"
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(ends.items()):
        f = folder / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size < end:
            return f"{rel} is cut short ({f.stat().st_size} of {end} bytes)"
    return None


def resume_point(root: str | Path, log=_warn) -> Path | None:
    """The newest complete checkpoint under root that is intact (None: there is none yet).
    Newer ones that are damaged are skipped, each named through `log` with what is wrong;
    when every one is damaged the run stops (ConfigError) instead of starting over silently."""
    damaged = []
    for path in reversed(complete_checkpoints(root)):
        problem = checkpoint_problem(path)
        if problem is None:
            for bad, why in damaged:
                log(f"megarl: warning: checkpoint {bad} is damaged ({why}): resuming from {path.name} "
                    f"instead; remove {bad} once you have looked at it")
            return path
        damaged.append((path, problem))
    if damaged:
        listed = "; ".join(f"{p.name}: {why}" for p, why in damaged[:3])
        raise ConfigError(f"checkpoint.dir={str(root)!r}: every checkpoint is damaged ({listed}): remove them "
                          f"to start over, or set checkpoint.dir to another folder")
    return None


def _ensure_optimizer_state(optimizer) -> None:
    """A fresh torch Adam has no state until its first step, and megatron's distributed
    optimizer (without Apex/TE) cannot describe an empty state for loading; megatron's own
    remedy (used on its FSDP path) is one zero-gradient step. The state it creates is then
    overwritten by the load."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def frozen_names(module) -> set[str]:
    """The parameters of `module` that do not train (with LoRA: the base weights, models/lora.py)."""
    return {n for n, p in module.named_parameters() if not p.requires_grad}


def _sharded(t: Trainable, is_loading: bool) -> dict:
    if is_loading:
        _ensure_optimizer_state(t.optimizer)
    model_sd = t.model.module.sharded_state_dict()
    frozen = frozen_names(t.model.module)
    if frozen:
        # LoRA: the frozen base is model.path's, loaded from there at every start (models/setup.py);
        # a copy in every checkpoint would cost the model's size each save for bytes that never
        # change. The checkpoint holds the trained tensors and their optimizer state only.
        model_sd = {k: v for k, v in model_sd.items() if k not in frozen}
    return {"model": model_sd,
            "optimizer": t.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIMIZER_METADATA)}


def save_trainable(t: Trainable, folder: Path) -> None:
    if _is_rank0():
        folder.mkdir(parents=True, exist_ok=True)
    _barrier()
    dist_checkpointing.save(_sharded(t, is_loading=False), str(folder))
    if _is_rank0():
        torch.save(t.scheduler.state_dict(), folder / "scheduler.pt")
        if frozen_names(t.model.module):   # what the adapters were trained on (compat.py checks model.path)
            base = getattr(t.info.hf_config, "_name_or_path", "")
            (folder / BASE_FILE).write_text(json.dumps({"base": os.path.abspath(base) if base else "",
                                                        "holds": "trained tensors only (LoRA adapters)"}))


def load_trainable(t: Trainable, folder: Path) -> None:
    sharded = _sharded(t, is_loading=True)
    state = dist_checkpointing.load(sharded, str(folder))
    frozen = frozen_names(t.model.module)
    missing, unexpected = t.model.module.load_state_dict(state["model"], strict=not frozen)
    # with LoRA only the frozen base (model.path's, already loaded) may be absent
    if set(missing) - frozen or unexpected:
        raise RuntimeError(f"the checkpoint lacks {sorted(set(missing) - frozen)[:3]} or holds unknown "
                           f"{sorted(unexpected)[:3]}")
    # a checkpoint of another expert-parallel size holds its optimizers' param groups in its
    # own structure: into this run's (optimizer_layout.py)
    t.optimizer.load_state_dict(to_this_layout(sharded["optimizer"], state["optimizer"]))
    t.optimizer.reload_model_params()  # main (fp32) params from the loaded model params
    _unshare_adam_steps(t.optimizer)
    t.scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))


def _unshare_adam_steps(optimizer) -> None:
    """megatron restores torch Adam's per-parameter `step` as ONE tensor shared by every
    parameter; torch increments it in place once per parameter, so after a resume the bias
    correction would run ahead. Give each parameter its own copy."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def room_problem(root: Path, need: int, free: int, step: int, previous: Path) -> str | None:
    """Why a save of about `need` bytes (the previous checkpoint's size) does not fit in `free`."""
    if free >= need:
        return None
    return (f"checkpoint step_{step} needs about {need >> 20} MiB (the size of {previous.name}) but "
            f"{root} has {free >> 20} MiB free; {_intact(previous)}: free space there, lower "
            f"checkpoint.keep, or set checkpoint.dir to a filesystem with room")


def _intact(previous: Path | None) -> str:
    return (f"the previous checkpoint {previous} is intact and a rerun resumes from it" if previous
            else "no checkpoint was saved yet")


FULL_BYTES = 4 << 20        # less free than this after a failed write: the disk filled up
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\]")


def _disk_errno(err: BaseException) -> int | None:
    """The errno of an OSError anywhere in err's chain (torch.distributed.checkpoint wraps a
    writer's exception in a CheckpointException holding each rank's failure), or named in
    the text of one."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
        # megatron's file writer runs in worker processes and re-raises their error as text:
        # RuntimeError("Worker failure: [Errno 28] No space left on device")
        if m := _ERRNO_TEXT.search(str(e)):
            return int(m.group(1))
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)   # CheckpointException: {rank: (exception, trace)}
        if isinstance(failures, dict):
            for f in failures.values():
                todo.append(f[0] if isinstance(f, tuple) else f)
    return None


def _is_full(root: Path) -> bool:
    try:
        return shutil.disk_usage(root).free < FULL_BYTES
    except OSError:
        return False


def driver_state(step: int, components: StateRegistry) -> dict:
    """driver.pt's content: the step, the weight version its weights are (step + 1: the update
    of step k makes version k + 1) and each registered component's state under its name."""
    return {"step": step, "version": step + 1, **components.state_dict()}


def restore(driver: dict, components: StateRegistry) -> int:
    """Hands each registered component its state from a loaded driver.pt (`load`'s result);
    returns the step to continue at."""
    components.load_state_dict(driver)
    return driver["step"] + 1


def save(root: str | Path, step: int, actor: Trainable, critic: Trainable | None,
         driver: dict | StateRegistry, config_text: str, keep: int) -> Path:
    """Collective. Writes step_<step> atomically and prunes to the newest `keep`. `driver`:
    the registered components (their states are taken first, see `driver_state`), or the
    content of driver.pt as it is.

    Raises CheckpointError, with the previous checkpoint intact and no partial folder left,
    when the filesystem refuses the write (checked up front against the previous checkpoint's
    size, and caught if it fills during the write)."""
    if isinstance(driver, StateRegistry):
        driver = driver_state(step, driver)
    root = Path(root)
    tmp, final = root / f"tmp_step_{step}", root / f"step_{step}"
    done = complete_checkpoints(root) if _is_rank0() else []
    previous = done[-1] if done else None
    problem = None
    if _is_rank0():
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        if previous is not None:
            need = folder_bytes(previous) * 21 // 20    # 5% margin: optimizer metadata grows
            problem = room_problem(root, need, shutil.disk_usage(root).free, step, previous)
    problem = from_rank0(problem)   # a refusal stops every rank, none left waiting
    if problem:
        raise CheckpointError(problem)
    try:
        if _is_rank0():
            tmp.mkdir(parents=True)
        _barrier()
        save_trainable(actor, tmp / "actor")
        if critic is not None:
            save_trainable(critic, tmp / "critic")
        faults.point("save")
        if _is_rank0():
            torch.save(driver, tmp / "driver.pt")
            (tmp / "config.yaml").write_text(config_text)
            (tmp / "COMPLETE").write_text(str(step))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in complete_checkpoints(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:   # torch's CheckpointException is a BaseException
        code = _disk_errno(err)
        if code is None and _is_full(root):
            # a short write can surface without an errno at all (torch.save's zip writer:
            # "enforce fail at inline_container.cc ... unexpected pos"): the disk says why
            code = errno.ENOSPC
        if code not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EFBIG):
            raise
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"checkpoint step_{step} could not be written to {root}: "
                              f"{os.strerror(code)}; the partial folder was removed and "
                              f"{_intact(previous)}: free space there, or set checkpoint.dir to a "
                              f"filesystem with room") from err
    _barrier()
    return final


def load(path: str | Path, actor: Trainable, critic: Trainable | None) -> dict:
    """Collective. Restores models and optimizers in place; returns the driver state."""
    path = Path(path)
    if critic is not None and not (path / "critic").exists():
        raise FileNotFoundError(f"checkpoint {path} has no critic/ (it was written by a run "
                                f"without a critic, e.g. algo.name=grpo); resume with the same algo.name")
    for model, folder in ((actor, "actor"), (critic, "critic")):
        if model is None:
            continue
        try:
            load_trainable(model, path / folder)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as err:   # noqa: BLE001 - megatron raises several types for a mismatch
            first = (str(err).strip().splitlines() or [""])[0][:300]
            raise ConfigError(f"checkpoint {path}/{folder} does not load into this run's {folder} "
                              f"({type(err).__name__}: {first}): it was written with another model or "
                              f"layout ({path}/config.yaml holds its settings); resume with those, or start "
                              f"over with checkpoint.resume=false or another checkpoint.dir") from err
    # plain data only (numbers, strings, lists, dicts, tensors): nothing in a checkpoint can run code
    return torch.load(path / "driver.pt", weights_only=True)
