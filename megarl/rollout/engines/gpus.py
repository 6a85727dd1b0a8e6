"""Which GPUs of the node the trainer ranks and the engines megarl starts (`inprocess`,
`local_servers`) run on.

Trainer rank `local_rank` drives the node's visible GPU number `local_rank`
(`distributed/device.select`), so the trainer ranks of a node take the first
`trainer_ranks` visible GPUs. The engines get GPUs of their own: by default the node's GPUs the
trainer ranks do not use, `rollout.engines.tp` per engine in order; `rollout.engines.gpus`
names them instead. Each engine's processes start with `CUDA_VISIBLE_DEVICES` set to its own
(`build.engine_env`). Only where the trainer leaves no GPU free (one GPU, one rank) do the
engines share global rank 0's GPU, as before: they inherit `CUDA_VISIBLE_DEVICES`, and the
weights travel over CUDA IPC (`weight_sync.backend=auto` resolves to ipc); on GPUs of their own
they travel over NCCL.

`split_gpus` is pure (device lists in, device lists out); `node_split` reads this process's
node.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from megarl.config.errors import ConfigError


@dataclass(frozen=True)
class GpuSplit:
    trainer: tuple[str, ...]               # the trainer ranks' GPUs, local rank order
    engines: tuple[tuple[str, ...], ...]   # engine i's GPUs (its CUDA_VISIBLE_DEVICES)
    shared: bool                           # the engines share global rank 0's GPU (no GPU left to them)

    def engine_env(self, i: int) -> dict:
        """CUDA_VISIBLE_DEVICES of engine i's processes; {} when shared (inherited)."""
        return {} if self.shared else {"CUDA_VISIBLE_DEVICES": ",".join(self.engines[i])}

    def describe(self) -> str:
        """One line: 'trainer GPUs 0,1,2,3 | engine 0: 4 | engine 1: 5 | ...'."""
        parts = [f"trainer GPUs {','.join(self.trainer)}"]
        if self.shared:
            return parts[0] + f" | {len(self.engines)} engines on global rank 0's GPU (shared)"
        return " | ".join(parts + [f"engine {i}: {','.join(g)}" for i, g in enumerate(self.engines)])


def split_gpus(visible: list, trainer_ranks: int, engines: int, tp: int, chosen: list = ()) -> GpuSplit:
    """The trainer's and each engine's GPUs on a node whose visible GPUs are `visible` (the ids
    of CUDA_VISIBLE_DEVICES, in order), with `trainer_ranks` trainer ranks on it and `engines`
    engines of TP `tp`. `chosen`: rollout.engines.gpus (empty: the GPUs the trainer leaves).
    ConfigError, one line, for chosen GPUs that are not visible, repeated or the trainer's, and
    for too few GPUs."""
    visible = [str(v) for v in visible]
    need = engines * tp
    if trainer_ranks > len(visible):
        raise ConfigError(f"{trainer_ranks} trainer ranks on this node, which shows {len(visible)} GPUs "
                          f"({','.join(visible) or 'none'}): launch at most that many ranks per node")
    trainer = visible[:trainer_ranks]
    if chosen:
        chosen = [str(c) for c in chosen]
        bad = [c for c in chosen if c not in visible]
        if bad:
            raise ConfigError(f"rollout.engines.gpus={chosen}: {','.join(bad)} not among this node's visible GPUs "
                              f"({','.join(visible)})")
        if len(set(chosen)) != len(chosen):
            raise ConfigError(f"rollout.engines.gpus={chosen}: a GPU listed twice; give each engine GPU once")
        overlap = [c for c in chosen if c in trainer]
        if overlap:
            raise ConfigError(f"rollout.engines.gpus={chosen} overlaps the trainer's GPUs ({','.join(trainer)}) on "
                              f"{','.join(overlap)}: give the engines GPUs the trainer ranks do not use")
        if len(chosen) < need:
            raise ConfigError(f"rollout.engines.gpus={chosen}: {len(chosen)} GPUs for {engines} engines x "
                              f"rollout.engines.tp={tp} = {need}: list {need}, or lower rollout.engines.count")
        free = chosen
    else:
        free = visible[trainer_ranks:]
        if not free:   # one GPU per trainer rank and none left: the engines share rank 0's (ipc)
            return GpuSplit(tuple(trainer), tuple(tuple(visible[:tp]) for _ in range(engines)), True)
        if len(free) < need:
            raise ConfigError(f"{engines} engines x rollout.engines.tp={tp} need {need} GPUs of their own; this node's "
                              f"{len(visible)} GPUs less the trainer's {trainer_ranks} leave {len(free)} "
                              f"({','.join(free)}): lower rollout.engines.count to {len(free) // tp}, launch fewer "
                              f"trainer ranks per node, or name the GPUs with rollout.engines.gpus")
    return GpuSplit(tuple(trainer), tuple(tuple(free[i * tp:(i + 1) * tp]) for i in range(engines)), False)


def visible_gpus() -> list[str]:
    """This process's visible GPUs by id ([] without CUDA)."""
    import torch
    if not torch.cuda.is_available():
        return []
    ids = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if ids:
        return [i.strip() for i in ids.split(",") if i.strip()][:torch.cuda.device_count()]
    return [str(i) for i in range(torch.cuda.device_count())]


def trainer_ranks_here() -> int:
    """The trainer ranks on this node: torchrun's LOCAL_WORLD_SIZE, srun's tasks per node, else 1."""
    e = os.environ
    if "LOCAL_WORLD_SIZE" in e:
        return int(e["LOCAL_WORLD_SIZE"])
    if "SLURM_NTASKS_PER_NODE" in e:
        return int(e["SLURM_NTASKS_PER_NODE"].split("(")[0].split(",")[0])
    return 1


def node_split(engines_cfg) -> GpuSplit | None:
    """The split of this node (an EnginesConfig), None without CUDA or for remote engines."""
    visible = visible_gpus()
    if not visible or engines_cfg.mode == "remote":
        return None
    return split_gpus(visible, trainer_ranks_here(), engines_cfg.count, engines_cfg.tp, engines_cfg.gpus)


def own_gpus(engines_cfg) -> bool:
    """Whether the engines megarl starts on this node run on GPUs of their own (then
    weight_sync.backend=auto is nccl, not ipc)."""
    split = node_split(engines_cfg)
    return split is not None and not split.shared
