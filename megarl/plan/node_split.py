"""The GPU split of a one-node recipe (cluster.nodes=1, no engine nodes, engines megarl starts):
which of the node's GPUs the trainer ranks use and which each engine gets, as
`rollout/engines/gpus.split_gpus` splits them at run time.

At run time the trainer ranks of the node take its first LOCAL_WORLD_SIZE GPUs. The plan,
which has no launcher to ask, gives the trainer the GPUs the engines leave at the front: all
but rollout.engines.count x rollout.engines.tp by default, those before the first of
rollout.engines.gpus when they are named. A node the engines would fill whole (one GPU, one
engine) keeps its GPUs for the trainer and the engines share global rank 0's, as at run time.
"""
from __future__ import annotations

from megarl.config.schema import RootConfig
from megarl.rollout.engines.gpus import GpuSplit, split_gpus


def one_node_split(cfg: RootConfig) -> GpuSplit | None:
    """`cfg`'s split of its one node (cfg.cluster as the plan resolved it), None for a recipe
    whose engines are remote or on nodes of their own, or a CPU one. ConfigError (one line) for
    named GPUs the node does not have, that overlap or are too few (split_gpus)."""
    c, e = cfg.cluster, cfg.rollout.engines
    if c.nodes != 1 or c.engine_nodes or not c.gpus_per_node or e.mode == "remote":
        return None
    g, need = c.gpus_per_node, e.count * e.tp
    trainer = min(e.gpus) if e.gpus else g - need
    return split_gpus(list(range(g)), trainer if trainer >= 1 else g, e.count, e.tp, e.gpus)
