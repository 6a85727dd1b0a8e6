"""The weight transfer's share of a plan: its packed GPU buffers (weight_sync.transport=
collective over NCCL) on the sending trainer GPU and every engine GPU, over CUDA IPC (backend
ipc) the whole model held on the sending GPU, or what a sync over files stages on disk instead.
With LoRA and weight_sync.lora=adapters a push carries the adapters alone (plan/lora.py), and
every figure here is of them."""
from __future__ import annotations

from megarl.config.schema import ConfigError, RootConfig
from megarl.models.arch import Arch
from megarl.plan import lora as plan_lora
from megarl.plan import memory as mem
from megarl.plan.memory import gib
from megarl.plan.node_split import one_node_split


def plan_backend(cfg: RootConfig) -> str:
    """The collective backend of a GPU run of `cfg` on the plan's cluster. Engines on nodes of
    their own (cluster.engine_nodes) are remote to the trainer (the cluster scripts pass
    rollout.engines.mode=remote): auto is nccl there, and ipc cannot reach them; without engine
    nodes the recipe's rollout.engines.mode decides (WeightSyncConfig.resolved_backend), and on
    one node whether its engines get GPUs of their own (plan/node_split.py): nccl, else ipc."""
    ws = cfg.weight_sync
    if not cfg.cluster.engine_nodes:
        split = one_node_split(cfg)
        return ws.resolved_backend(True, cfg.rollout.engines.mode, own_gpus=split is not None and not split.shared)
    if ws.backend == "ipc":
        raise ConfigError(f"weight_sync.backend='ipc' shares global rank 0's GPU memory with engines on its node, and "
                          f"cluster.engine_nodes={cfg.cluster.engine_nodes} puts the engines on nodes of their own: "
                          f"use weight_sync.backend=auto (nccl for them), or cluster.engine_nodes=0")
    return ws.resolved_backend(True, "remote")


def push_bytes(cfg: RootConfig, arch: Arch) -> float:
    """Bytes one push carries: the whole model (full fine-tuning; LoRA with weight_sync.lora=
    merged, the adapters merged into the weights they adapt), or the adapters alone (weight_sync.
    lora=adapters), at the trainer's model.dtype."""
    return plan_lora.pushed_params(cfg, arch, mem.total_params(arch)) * mem.DTYPE_BYTES[cfg.model.dtype]


def transfer_buffers(cfg: RootConfig, arch: Arch) -> float:
    """GPU bytes of the weight transfer on the sending trainer GPU (global rank 0): nccl's
    packed buffers (`memory.transfer_buffer_bytes`), which every engine GPU holds too
    (`engine_transfer_buffers`); ipc's whole model held until the finish
    (`memory.ipc_sender_bytes`). 0 for weight_sync.transport=files (the weights are staged as
    files instead: see `staging_note`) and for backend=gloo (its buffers are host memory)."""
    ws = cfg.weight_sync
    backend = plan_backend(cfg) if ws.transport == "collective" else ""
    if backend not in ("nccl", "ipc"):
        return 0
    plan_lora.check_push_route(cfg, backend)   # adapters travel on the gloo wire only: no GPU buffers
    size = mem.ipc_sender_bytes if backend == "ipc" else mem.transfer_buffer_bytes
    return size(arch, ws.bucket_mb, ws.num_buffers, mem.DTYPE_BYTES[cfg.model.dtype])


def engine_transfer_buffers(cfg: RootConfig, arch: Arch) -> float:
    """GPU bytes of the weight transfer on every engine GPU: nccl's receive buffers (as many as
    the sender's); none with ipc (the engine reads the sender's buffers in place), gloo (host
    memory) or files."""
    if cfg.weight_sync.transport != "collective" or plan_backend(cfg) != "nccl":
        return 0
    return transfer_buffers(cfg, arch)


def transfer_formula(cfg: RootConfig, arch: Arch) -> str:
    """How `transfer_buffers` came about, with the settings that set it, for the printed plan."""
    ws = cfg.weight_sync
    if plan_lora.adapters_pushed(cfg):
        lora = cfg.model.lora
        big = plan_lora.largest_adapter_tensor(arch, lora.rank, lora.targets) * mem.DTYPE_BYTES[cfg.model.dtype]
        buffers = (f"the adapters only (weight_sync.lora=adapters): weight_sync.num_buffers={ws.num_buffers} x "
                   f"(weight_sync.bucket_mb={ws.bucket_mb} MiB + largest adapter {gib(big)} GiB), at most the "
                   f"adapters' {gib(push_bytes(cfg, arch))} GiB")
    else:
        big = mem.largest_hf_tensor(arch) * mem.DTYPE_BYTES[cfg.model.dtype]
        buffers = (f"weight_sync.num_buffers={ws.num_buffers} x (weight_sync.bucket_mb={ws.bucket_mb} MiB "
                   f"+ largest tensor {gib(big)} GiB)")
    if ws.transport == "collective" and plan_backend(cfg) == "ipc":
        what = "the adapters" if plan_lora.adapters_pushed(cfg) else "the whole model"
        return f"{what} {gib(push_bytes(cfg, arch))} GiB (weight_sync.backend=ipc: held until the engines finish) + " \
            f"{buffers}"
    return buffers


def staging_note(cfg: RootConfig, arch: Arch) -> str:
    """What a sync over files needs on disk (not on a GPU): the whole model as safetensors,
    written by the trainer and read by every engine, every step."""
    ws = cfg.weight_sync
    size = push_bytes(cfg, arch)
    what = "the adapters (weight_sync.lora=adapters)" if plan_lora.adapters_pushed(cfg) else "the whole model"
    if ws.transport == "files":
        return (f"weight_sync.transport=files: every sync stages {what}, {gib(size)} GiB, as files under "
                f"weight_sync.staging_dir={ws.staging_dir} (host memory for /dev/shm, else disk), which every engine "
                f"must reach (a shared file system on a cluster) and reads in full; no GPU transfer buffers")
    if plan_backend(cfg) == "gloo":
        return (f"weight_sync.backend=gloo: the transfer's buffers ({transfer_formula(cfg, arch)}) are host memory "
                f"on global rank 0 and on every engine worker, not counted on the GPUs")
    if plan_backend(cfg) == "ipc":
        return (f"weight_sync.backend=ipc: the engines (on global rank 0's node, TP=1) read global rank 0's packed "
                f"buffers in place over CUDA IPC, so during a sync its GPU holds {transfer_formula(cfg, arch)}; "
                f"the engine GPUs hold no transfer buffers")
    return ""


def staging_place(cfg: RootConfig) -> str:
    """Where a staged update's staging area lives (weight_sync.staged, collective only): "host"
    on the gloo wire (CPU engines: the worker's memory), "gpu" on the GPU wires (beside the
    worker's weights, so the swap is a copy on the device), "" when nothing is staged."""
    ws = cfg.weight_sync
    if ws.transport != "collective" or not ws.staged or plan_lora.adapters_pushed(cfg):
        return ""   # (an adapters push is unstaged: the engines pause for its receive and swap)
    return "host" if plan_backend(cfg) == "gloo" else "gpu"


def staging_bytes(cfg: RootConfig, arch: Arch) -> float:
    """Bytes of one engine worker's staging area: the new version of what the worker holds.
    On a GPU that is its slice (the bf16 weights / engine TP). On the gloo wire every worker
    stages the model's HF tensors whole (received whole, or assembled whole from every sender's
    pieces with weight_sync.sharded: rollout/weights/pieces.py), and prepares the new version
    beside its model (rollout/weights/shadow.py: one more copy of its own weights, from the
    first bucket to the swap). 0 when nothing is staged."""
    place = staging_place(cfg)
    if not place:
        return 0.0
    slice_bytes = mem.engine_weight_bytes(arch, cfg.rollout.engines.tp)
    if place == "host":
        return mem.total_params(arch) * mem.DTYPE_BYTES[cfg.model.dtype] + slice_bytes
    return slice_bytes


def staging_line(cfg: RootConfig, arch: Arch) -> str:
    """The staging area as the plan prints it: its size per engine worker and where it lives."""
    size = staging_bytes(cfg, arch)
    if not size:
        return ""
    if staging_place(cfg) == "host":
        return (f"weight_sync.staged: a staging area of {gib(size)} GiB (every tensor whole, and the version "
                f"prepared beside the model until the swap) in host memory of every engine worker (gloo wire), "
                f"not counted on a GPU")
    return (f"weight_sync.staged: a staging area of {gib(size)} GiB (the worker's slice) per engine GPU, checked in "
            f"its budget (it takes what would be KV cache); the GPU wires (nccl, ipc) do not stage yet: a push "
            f"pauses the engines for its whole length there")
