"""What surrounds a run: the weight push, metrics, checkpoints and the cluster it is sized for."""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.config.schema.checks import changed, one_of, require
from megarl.config.schema.rollout import LOCAL_ENGINE_MODES


@dataclass
class WeightSyncConfig:
    """How the actor's weights reach the engines after each step (docs/engines.md, "Weight sync")."""
    # collective: one broadcast from trainer rank 0 to every engine worker through vLLM's
    # weight-transfer API, nothing on disk | files: safetensors staged in staging_dir, each
    # engine reloads them (for servers started without megarl's weight-transfer config)
    transport: str = "collective"
    # collective: auto | gloo (megarl's backend, CPU) | nccl (vLLM's: engines on GPUs of their own,
    # remote engines) | ipc (vLLM's CUDA IPC: engines megarl starts on the trainer's node read rank 0's
    # GPU memory in place; rollout.engines.tp=1 only). auto: gloo without CUDA; with CUDA ipc for
    # rollout.engines.mode=inprocess | local_servers (their TP=1 engine shares global rank 0's GPU,
    # where NCCL refuses two ranks of one communicator), nccl for remote (`resolved_backend`)
    backend: str = "auto"
    # rendezvous of the weight group, reached by every engine worker: "" = this host's address as
    # the engines see it (127.0.0.1 for engines on this machine, else $MASTER_ADDR or the hostname)
    master_addr: str = ""
    master_port: int = 0               # 0: a free port, new for every group
    bucket_mb: int = 512               # tensors are packed into buffers of about this size per broadcast
    # collective: packed buffers in flight per side (2: gather the next while one is on the wire)
    num_buffers: int = 2
    staging_dir: str = "/dev/shm"      # files: where the safetensors buckets are staged (engines must see it)
    verify: bool = False               # after each push, compare engine and trainer logprobs
    # collective: the new version travels into a staging buffer beside each engine worker while
    # the engines keep generating; they pause only to load it from there (docs/engines.md,
    # "Staged updates"). Costs one more copy of the weights per engine worker (host memory,
    # counted by `megarl plan`); false: the engines pause for the whole push. Only the gloo
    # wire stages: with nccl / ipc (vLLM's own receivers) the push pauses as with false.
    staged: bool = True
    # collective, staged, gloo wire: every trainer rank that owns shards sends the pieces of HF
    # tensors they cover (converted on the rank), so no rank gathers the model and each sender's
    # link carries its shard (docs/engines.md, "Sharded sends"); false, or a trainer where one
    # rank owns everything: trainer rank 0 gathers and sends every tensor. `megarl simulate` /
    # `megarl plan` cost the push by it.
    sharded: bool = True
    # with LoRA (model.lora.rank > 0), what travels after each step (docs/lora.md, "What
    # travels"): adapters: only the adapters (megabytes), swapped into each engine's vLLM LoRA
    # slot; the collective transport on the gloo wire (CPU engines) only | merged: each adapted
    # weight merged, W + (alpha / r) B A, computed per TP shard without a gather and sent under
    # the base's name by every transport and wire above (the engines need no LoRA)
    lora: str = "adapters"

    def __post_init__(self):
        one_of("weight_sync.transport", self.transport, {"collective", "files"})
        one_of("weight_sync.lora", self.lora, {"merged", "adapters"})
        one_of("weight_sync.backend", self.backend, {"auto", "gloo", "nccl", "ipc"})
        require(self.bucket_mb >= 1, "weight_sync.bucket_mb", self.bucket_mb, "must be >= 1")
        require(self.num_buffers >= 1, "weight_sync.num_buffers", self.num_buffers,
                 "must be >= 1 (2: the next bucket is gathered while one is sent)")
        require(0 <= self.master_port < 65536, "weight_sync.master_port", self.master_port,
                 "must be a TCP port (0: pick a free one)")

    def adapters_refusal(self, wire: str) -> str:
        """Why weight_sync.lora=adapters cannot run on this transport and `wire` (the resolved
        backend), in one line naming the fix; "" where it runs (the collective transport on the
        gloo wire: rollout/weights/adapters.py)."""
        if self.transport != "collective":
            return (f"weight_sync.lora=adapters with weight_sync.transport={self.transport}: only the collective "
                    f"transport carries adapters (the files route reloads whole weights): set "
                    f"weight_sync.transport=collective or weight_sync.lora=merged")
        if wire not in ("gloo", "auto"):
            return (f"weight_sync.lora=adapters on the {wire} wire (weight_sync.backend={self.backend}): vLLM's {wire} "
                    f"receiver loads every tensor into the model and has no adapter path yet; use "
                    f"weight_sync.lora=merged on GPUs, or weight_sync.backend=gloo")
        return ""

    def resolved_backend(self, cuda: bool, engine_mode: str, own_gpus: bool = False) -> str:
        """The collective backend actually used with engines of rollout.engines.mode `engine_mode`:
        `auto` is gloo without CUDA; with CUDA nccl for remote engines and for engines megarl
        starts on GPUs of their own (`own_gpus`: rollout/engines/gpus.py), ipc for those sharing
        global rank 0's GPU (LOCAL_ENGINE_MODES with no GPU left to them).
        ipc with remote engines raises ConfigError (they cannot map this process's GPU memory)."""
        if self.backend == "auto":
            local = engine_mode in LOCAL_ENGINE_MODES and not own_gpus
            return "gloo" if not cuda else "ipc" if local else "nccl"
        require(self.backend != "ipc" or engine_mode in LOCAL_ENGINE_MODES, "weight_sync.backend",
                 self.backend, f"needs engines megarl starts on the trainer's node (rollout.engines.mode="
                 f"inprocess or local_servers), not rollout.engines.mode={engine_mode}: another machine's engines "
                 f"cannot map this process's GPU memory; use weight_sync.backend=nccl (or auto) for them")
        return self.backend

    def check_engines(self, cuda: bool, engine_mode: str, engine_tp: int, own_gpus: bool = False) -> str:
        """`resolved_backend`, refused (ConfigError) where it cannot serve engines of TP
        `engine_tp`: ipc needs TP=1 (global rank 0 exports handles of its own GPU only)."""
        backend = self.resolved_backend(cuda, engine_mode, own_gpus)
        require(backend != "ipc" or not own_gpus, "weight_sync.backend", self.backend,
                 "cannot serve engines on GPUs of their own (rollout.engines.gpus, or the GPUs the trainer "
                 "ranks leave): they cannot map global rank 0's GPU memory; use weight_sync.backend=auto (nccl)")
        why = "resolves to ipc here (CUDA, engines megarl starts), which " if self.backend == "auto" else ""
        require(backend != "ipc" or engine_tp == 1, "weight_sync.backend", self.backend,
                 f"{why}cannot serve engines of rollout.engines.tp={engine_tp}: global rank 0 exports CUDA IPC "
                 f"handles of its own GPU only, and a TP={engine_tp} engine's other workers run on other GPUs: use "
                 f"rollout.engines.tp=1 (more engines: rollout.engines.count), engines on GPUs of their own "
                 f"(rollout.engines.mode=remote, weight_sync.backend=nccl), or weight_sync.transport=files")
        return backend


@dataclass
class WandbConfig:
    """`metrics.wandb.*`: the rows of metrics.jsonl and the resolved config in Weights & Biases too
    (the optional `wandb` package: pip install megarl[wandb]). Off while `project` is empty. Its
    files go under <run.dir>/wandb; a resumed run continues the same W&B run (docs/metrics.md)."""
    project: str = ""                  # the W&B project; empty: no W&B
    entity: str = ""                   # team or user; empty: wandb's default (the logged-in user)
    name: str = ""                     # the run's display name; empty: the name of the run.dir folder
    tags: list[str] = field(default_factory=list)
    # online | offline (files only; `wandb sync` uploads them later) | disabled; empty: $WANDB_MODE,
    # else online
    mode: str = ""

    def __post_init__(self):
        one_of("metrics.wandb.mode", self.mode, {"", "online", "offline", "disabled"})
        require(bool(self.project) or not changed(self, {"entity", "name", "tags", "mode"}),
                "metrics.wandb.project", self.project, "is empty, so the other metrics.wandb.* settings are "
                "unused: set metrics.wandb.project to log to Weights & Biases, or remove them")


@dataclass
class MetricsConfig:
    tensorboard: bool = True           # write TensorBoard event files under <run.dir>/tensorboard
    progress: bool = True              # one console line per step
    wandb: WandbConfig = field(default_factory=WandbConfig)   # Weights & Biases too (off by default)


@dataclass
class CheckpointConfig:
    dir: str = ""                      # where step_<N>/ folders go; empty: <run.dir>/checkpoints
    every: int = 0                     # save every this many steps (0: only at the end and on SIGTERM)
    keep: int = 2                      # newest complete checkpoints kept
    # true: continue from the newest complete checkpoint if one exists (refused when it was
    # written with another algo.name or model: megarl check names what changed) | false: start
    # over | force: resume even across such a change
    resume: str = "true"
    time_budget_min: float = 0.0       # save and stop after this many minutes of wall clock (0: none)
    # Hugging Face exports of the actor (README.md, "Hugging Face exports"): <run.dir>/hf/step_<N>
    # every this many steps (0: none), <run.dir>/hf/final after the run's last step; safetensors
    # shards of about hf_shard_mb MiB
    hf_every: int = 0
    hf_final: bool = False
    hf_shard_mb: int = 2048

    def __post_init__(self):
        require(self.every >= 0, "checkpoint.every", self.every, "must be >= 0")
        require(self.hf_every >= 0, "checkpoint.hf_every", self.hf_every, "must be >= 0 (0: no export during the run)")
        require(self.hf_shard_mb >= 1, "checkpoint.hf_shard_mb", self.hf_shard_mb,
                "must be >= 1 (MiB per safetensors shard)")
        require(self.keep >= 1, "checkpoint.keep", self.keep, "must be >= 1")
        require(self.time_budget_min >= 0, "checkpoint.time_budget_min", self.time_budget_min, "must be >= 0")
        self.resume = _resume_mode(self.resume)


_RESUME = {"true": True, "on": True, "yes": True, "false": False, "off": False, "no": False, "force": "force"}


def _resume_mode(value) -> bool | str:
    """checkpoint.resume as True, False or "force" (YAML's true/false arrive as text)."""
    word = str(value).lower()
    require(word in _RESUME, "checkpoint.resume", value,
            "must be true (resume), false (start over) or force (resume across a changed algo.name or model)")
    return _RESUME[word]


@dataclass
class ClusterConfig:
    """The hardware a recipe is sized for: `megarl plan` checks placement and memory against
    it, cluster scripts read the node split. gpus_per_node=0 (the default): a CPU-only
    machine, nothing to place."""
    nodes: int = 1                     # machines in the allocation
    gpus_per_node: int = 0             # accelerators per node; 0: CPU only
    gpu_mem_gb: float = 80.0           # memory per GPU, GiB (H100-80GB: 80, H200: 141)
    gpu: str = ""                      # informative name, e.g. H100-SXM-80GB
    trainer_nodes: int = 0             # nodes of the trainer ranks; 0: nodes - engine_nodes
    engine_nodes: int = 0              # nodes of the vLLM engines (their own GPU pool)
    reserve_gb: float = 4.0            # per GPU, left out of every estimate: CUDA context, NCCL buffers, fragmentation

    def __post_init__(self):
        require(self.nodes >= 1, "cluster.nodes", self.nodes, "must be >= 1")
        require(self.gpus_per_node >= 0, "cluster.gpus_per_node", self.gpus_per_node,
                 "must be >= 0 (0: CPU only)")
        require(self.gpu_mem_gb > 0, "cluster.gpu_mem_gb", self.gpu_mem_gb, "must be > 0 (GiB per GPU)")
        require(self.trainer_nodes >= 0, "cluster.trainer_nodes", self.trainer_nodes, "must be >= 0")
        require(self.engine_nodes >= 0, "cluster.engine_nodes", self.engine_nodes, "must be >= 0")
        require(self.trainer_nodes + self.engine_nodes <= self.nodes, "cluster.trainer_nodes + engine_nodes",
                 self.trainer_nodes + self.engine_nodes, f"must be <= cluster.nodes={self.nodes}")
        require(0 <= self.reserve_gb < self.gpu_mem_gb, "cluster.reserve_gb", self.reserve_gb,
                 f"must be in [0, cluster.gpu_mem_gb={self.gpu_mem_gb})")

    @property
    def trainer_node_count(self) -> int:
        return self.trainer_nodes or self.nodes - self.engine_nodes
