"""What a plan starts from besides the policy's architecture (megarl/models/arch.py): the
reward model's architecture and the recipe's cluster with the command line's changes."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, replace

from megarl.config.schema import ClusterConfig, ConfigError, RootConfig
from megarl.models.arch import Arch, arch_from_hf


def reward_arch(cfg: RootConfig, policy: Arch) -> tuple[Arch | None, str]:
    if not cfg.reward.model_path:
        return None, ""
    path = os.path.join(cfg.reward.model_path, "config.json")
    try:
        with open(path) as fh:
            return replace(arch_from_hf(json.load(fh)), tied=True), path
    except (OSError, ValueError, KeyError):
        return policy, "assumed the policy's architecture (reward.model_path/config.json not readable here)"


def resolve_cluster(cfg: RootConfig, nodes: int | None = None, gpus_per_node: int | None = None,
                    gpu_mem_gb: float | None = None) -> tuple[ClusterConfig, list[str]]:
    """The recipe's cluster with command-line changes. A different node count keeps the
    recipe's trainer : engine split in proportion (whole nodes, at least one each)."""
    c, notes = cfg.cluster, []
    for key, v, least in (("--nodes", nodes, 1), ("--gpus-per-node", gpus_per_node, 0)):
        if v is not None and v < least:
            raise ConfigError(f"{key}={v}: must be >= {least}")
    if gpu_mem_gb is not None and gpu_mem_gb <= 0:
        raise ConfigError(f"--gpu-mem-gb={gpu_mem_gb}: must be > 0 (GiB per GPU)")
    kw = {}
    if gpus_per_node is not None:
        kw["gpus_per_node"] = gpus_per_node
    if gpu_mem_gb is not None:
        kw["gpu_mem_gb"] = gpu_mem_gb
    if nodes is not None and nodes != c.nodes:
        kw["nodes"] = nodes
        if c.engine_nodes:
            eng = max(1, round(c.engine_nodes * nodes / c.nodes))
            if eng >= nodes:
                raise ConfigError(f"--nodes={nodes}: the engines and the trainer each need whole nodes "
                                  f"(the recipe gives the engines {c.engine_nodes} of {c.nodes}); "
                                  f"give at least 2 nodes")
            kw["engine_nodes"], kw["trainer_nodes"] = eng, nodes - eng
            notes.append(f"--nodes={nodes}: split as in the recipe ({c.trainer_node_count}:{c.engine_nodes}) "
                         f"-> trainer {nodes - eng}, engines {eng} nodes")
        elif c.trainer_nodes:
            kw["trainer_nodes"] = nodes
    # a new ClusterConfig re-runs the schema's checks on the changed values
    return ClusterConfig(**{**asdict(c), **kw}), notes
