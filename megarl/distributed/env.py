"""Who am I: rank and world from torchrun or SLURM, and the torch.distributed init."""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.distributed import device


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int


def free_port() -> int:
    """A TCP port free on this host now (for a single-host rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_listen(host: str, port: int = 0) -> None:
    """OSError unless a socket of this machine can listen at `host`:`port` (an address or a
    name; port 0: any). torch's TCPStore, given an address that is not this machine's, retries
    until its timeout instead of failing."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)


def read_env() -> DistEnv:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; `srun` sets SLURM_PROCID/SLURM_NTASKS/
    SLURM_LOCALID; neither means a single process."""
    e = os.environ
    if "RANK" in e and "WORLD_SIZE" in e:
        return DistEnv(int(e["RANK"]), int(e["WORLD_SIZE"]), int(e.get("LOCAL_RANK", 0)))
    if "SLURM_PROCID" in e and "SLURM_NTASKS" in e:
        return DistEnv(int(e["SLURM_PROCID"]), int(e["SLURM_NTASKS"]), int(e.get("SLURM_LOCALID", 0)))
    return DistEnv(0, 1, 0)


def init_distributed(backend: str = "auto", timeout_s: int = 600) -> DistEnv:
    """Initialise the default process group (idempotent) and return this rank's place."""
    env = read_env()
    if dist.is_initialized():
        return env
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if env.world_size == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    elif "MASTER_ADDR" not in os.environ:
        raise RuntimeError("MASTER_ADDR is not set: launch with torchrun, or export MASTER_ADDR/"
                           "MASTER_PORT before srun (slurm/common.sh does)")
    device.select(env.local_rank)   # before NCCL builds a communicator on the wrong GPU
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return env


def from_rank0(obj):
    """Global rank 0's `obj` on every rank (pickled; for small control data: a verdict, an
    outcome, a batch of samples). The object itself where there is one rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
