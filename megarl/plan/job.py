"""The layout of a slurm job (slurm/common.sh), from one place: the recipe's `cluster:` section.

The job runs the trainer on the first cluster.trainer_nodes nodes and vLLM servers on the next
cluster.engine_nodes, one server per rollout.engines.tp GPUs of each engine node (on CPU nodes:
rollout.engines.count spread over them). An environment variable of the same name as the job's
setting (TRAINER_NODES, ENGINE_NODES, GPUS_PER_NODE, ENGINE_TP, ENGINES_PER_NODE,
TRAINER_PROCS_PER_NODE) replaces the recipe's value, and the job log says so. The servers the
job starts replace rollout.engines.count; `job_engines` gives `megarl plan` the same count, so
the plan of a recipe answers what the job's own plan answers.

`python -m megarl.plan.job_shell RECIPE [key=value ...]` prints it for slurm/common.sh.
"""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field, replace
from typing import Mapping

from megarl.config.schema import ConfigError, RootConfig

# job setting -> the recipe key it comes from (None: derived, see job_layout)
SETTINGS = {"TRAINER_NODES": "cluster.trainer_nodes", "ENGINE_NODES": "cluster.engine_nodes",
            "GPUS_PER_NODE": "cluster.gpus_per_node", "ENGINE_TP": "rollout.engines.tp",
            "ENGINES_PER_NODE": None, "TRAINER_PROCS_PER_NODE": None}


@dataclass
class JobLayout:
    trainer_nodes: int
    engine_nodes: int
    gpus_per_node: int
    engine_tp: int
    engines_per_node: int
    trainer_procs_per_node: int
    transport: str
    notes: list[str] = field(default_factory=list)

    @property
    def nodes(self) -> int:
        return self.trainer_nodes + self.engine_nodes

    @property
    def engines(self) -> int:
        return self.engine_nodes * self.engines_per_node

    def overrides(self) -> list[str]:
        """What the job passes the trainer and the servers besides the servers' URLs: the
        layout it runs (which `megarl plan` checks) and the engines it starts."""
        out = [f"cluster.nodes={self.nodes}", f"cluster.trainer_nodes={self.trainer_nodes}",
               f"cluster.engine_nodes={self.engine_nodes}", f"rollout.engines.tp={self.engine_tp}",
               f"rollout.engines.count={self.engines}"]
        return out + ([f"cluster.gpus_per_node={self.gpus_per_node}"] if self.gpus_per_node else [])

    def shell(self) -> str:
        """The layout as bash assignments (slurm/common.sh evaluates them)."""
        values = {"TRAINER_NODES": self.trainer_nodes, "ENGINE_NODES": self.engine_nodes,
                  "GPUS_PER_NODE": self.gpus_per_node, "ENGINE_TP": self.engine_tp,
                  "ENGINES_PER_NODE": self.engines_per_node, "TRAINER_PROCS_PER_NODE": self.trainer_procs_per_node,
                  "JOB_NODES": self.nodes, "WEIGHT_TRANSPORT": self.transport}
        lines = [f"{k}={shlex.quote(str(v))}" for k, v in values.items()]
        lines.append("LAYOUT_OVERRIDES=(" + " ".join(shlex.quote(o) for o in self.overrides()) + ")")
        lines.append("LAYOUT_NOTES=(" + " ".join(shlex.quote(n) for n in self.notes) + ")")
        return "\n".join(lines)


def _from_env(env: Mapping[str, str], var: str, recipe_value: int, notes: list[str], least: int) -> int:
    raw = env.get(var, "")
    if raw == "":
        return recipe_value
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{var}={raw!r} (environment): must be a whole number") from None
    if value < least:
        raise ConfigError(f"{var}={value} (environment): must be >= {least}")
    key = SETTINGS[var]
    if value != recipe_value:
        notes.append(f"{var}={value} from the environment replaces "
                     + (f"the recipe's {key}={recipe_value}" if key else f"the default {recipe_value}"))
    return value


def job_layout(cfg: RootConfig, env: Mapping[str, str] | None = None) -> JobLayout:
    """The job's layout: the recipe's values, each replaced by its environment variable when set."""
    env = os.environ if env is None else env
    c, e, notes = cfg.cluster, cfg.rollout.engines, []
    trainer_nodes = _from_env(env, "TRAINER_NODES", c.trainer_node_count, notes, 1)
    engine_nodes = _from_env(env, "ENGINE_NODES", c.engine_nodes, notes, 0)
    if engine_nodes < 1:
        raise ConfigError("cluster.engine_nodes=0: a slurm job runs its vLLM servers on nodes of their own; "
                          "set cluster.engine_nodes in the recipe (or ENGINE_NODES in sbatch's environment)")
    gpus = _from_env(env, "GPUS_PER_NODE", c.gpus_per_node, notes, 0)
    tp = _from_env(env, "ENGINE_TP", e.tp, notes, 1)
    # GPU nodes: every engine node full of servers of tp GPUs; CPU nodes: the recipe's count spread
    per_node = _from_env(env, "ENGINES_PER_NODE", gpus // tp if gpus else max(1, -(-e.count // engine_nodes)),
                         notes, 1)
    if gpus and per_node * tp > gpus:
        raise ConfigError(f"ENGINES_PER_NODE={per_node} x ENGINE_TP={tp}: more than the {gpus} GPUs of an engine node")
    procs = _from_env(env, "TRAINER_PROCS_PER_NODE", gpus or 1, notes, 1)
    layout = JobLayout(trainer_nodes, engine_nodes, gpus, tp, per_node, procs, cfg.weight_sync.transport, notes)
    if e.mode != "remote" and layout.engines != e.count:
        notes.append(replaced_count(e.count, layout.engines, f"{engine_nodes} engine node(s) x {per_node} server(s)"))
    return layout


def replaced_count(count: int, started: int, how: str) -> str:
    return (f"rollout.engines.count={count} is replaced by the {started} servers the slurm job starts "
            f"({how}); plans and runs count {started}")


def job_engines(cfg: RootConfig, cluster) -> tuple[RootConfig, str]:
    """`cfg` with rollout.engines.count as the slurm job would start them on `cluster` (engine
    nodes of their own, GPUs, engines megarl starts), and the note saying so; else unchanged."""
    e = cfg.rollout.engines
    if e.mode == "remote" or not cluster.engine_nodes or not cluster.gpus_per_node:
        return cfg, ""
    started = cluster.engine_nodes * (cluster.gpus_per_node // e.tp)
    if started == e.count or started < 1:
        return cfg, ""
    how = f"cluster.engine_nodes={cluster.engine_nodes} x cluster.gpus_per_node={cluster.gpus_per_node} / " \
          f"rollout.engines.tp={e.tp}"
    return replace(cfg, rollout=replace(cfg.rollout, engines=replace(e, count=started))), \
        replaced_count(e.count, started, how)
