"""The weight push's costs in the simulator (docs/simulator.md, "Weight sync"): one sync by the
route the recipe's weight_sync settings take, split into what pauses the engines and what runs
while they generate.

- transport: collective (one group of the trainer and every engine worker) or files (written
  once, read by every engine).
- sharded (weight_sync.sharded, collective): every trainer rank sends the tensors it owns, so a
  trainer link carries the model / its distinct shard owners (TP x PP x EP) and an engine
  worker's link its own slice (model / engine TP); unsharded, rank 0 sends the whole model and
  every engine worker receives every tensor whole.
- staged (weight_sync.staged, collective): the bytes travel into a staging area beside each
  engine worker while the engines generate (the trainer is busy sending); the engines pause only
  for the local copy from there into the model. Unstaged, they pause for the whole push.

Pure functions of their inputs; every figure is a field of `WeightSyncCosts`, so a measurement
can replace it (bench/weight_sync.py fits seconds = fixed + per_byte x bytes per route).
"""
from __future__ import annotations

from dataclasses import dataclass

TRANSPORTS = ("collective", "files")


@dataclass(frozen=True)
class PushCost:
    """One sync. trainer_s: seconds on the trainer side while the engines still generate (the
    simulator sleeps them before the pool's update); paused_s: seconds every engine is paused
    (all in parallel: each engine's load_weights_s). wire_s: the bytes on the wire (inside
    paused_s unstaged, inside trainer_s staged); send_bytes / recv_bytes: bytes over one trainer
    link / one engine worker's link; load_s: the engine GPU's copy into its model."""
    trainer_s: float
    paused_s: float
    wire_s: float = 0.0
    send_bytes: float = 0.0
    recv_bytes: float = 0.0
    load_s: float = 0.0
    staged: bool = False
    sharded: bool = False


@dataclass(frozen=True)
class WeightSyncCosts:
    """The figures a sync's cost is made of, in bytes/s and seconds.

    collective: the bytes leave each sender's link once whatever the engine count (a pipelined
      broadcast), plus `per_engine_s` per engine (its start/update/finish control calls).
    files: the trainer writes the weights once into a shared folder and every engine reads all
      of it: the reads share the file system's bandwidth, so the time grows with the engines.
    Either way each engine GPU copies its share of the tensors into its model (`load`): from the
    receive buffers (unstaged), from the staging area (staged), both local copies."""
    # one 400 Gb/s NIC per GPU (DGX H100: 8 ConnectX-7 for 8 GPUs) = 50 GB/s, at 80%; the same
    # figure on a trainer GPU's link and an engine GPU's
    wire_bytes_per_s: float = 40e9
    per_engine_s: float = 0.05          # assumption, until bench/weight_sync.py measures 1 vs 2 engines
    # a parallel file system: one client's write stream, and the read bandwidth all engines
    # share (assumptions: sites differ by 10x; set them from a measurement)
    write_bytes_per_s: float = 5e9
    read_bytes_per_s: float = 20e9
    load_hbm_frac: float = 0.5          # engine-side copy at this share of its GPU's HBM bandwidth (read + write)
    # the local copy into the model from the staging area or receive buffers, bytes/s per engine
    # GPU; 0: load_hbm_frac x the GPU's HBM bandwidth (staging area on the engine GPU). A staging
    # area in pinned host memory would copy over PCIe instead (Gen5 x16: 64 GB/s, ~50 achieved)
    local_copy_bytes_per_s: float = 0.0
    # per sync, with the engines paused: pause, prefix-cache reset, version, resume (control
    # calls of milliseconds each) and vLLM's finalize of the reload. Assumption: the CPU bench's
    # fits put a push's fixed part at 0.03-0.16 s at 1x1 for one and two engines (bench/RESULTS.md,
    # "Weight sync"); 0.5 s before issue 47
    fixed_s: float = 0.1

    def copy_rate(self, gpu) -> float:
        return self.local_copy_bytes_per_s or gpu.hbm_bytes_per_s * self.load_hbm_frac

    def push(self, transport: str, weight_bytes: float, engines: int, engine_tp: int, gpu,
             staged: bool = False, sharded: bool = False, owners: int = 1) -> PushCost:
        """One sync of `weight_bytes` to `engines` engines of `engine_tp` GPUs each; `owners`:
        the trainer's distinct shard owners (TP x PP x EP) when `sharded`. staged and sharded
        apply to the collective route only (files: the engines read the folder paused)."""
        if transport not in TRANSPORTS:
            raise ValueError(f"weight_sync.transport={transport!r}: choose one of {TRANSPORTS}")
        if owners < 1 or engine_tp < 1:
            raise ValueError(f"owners={owners}, engine_tp={engine_tp}: each must be >= 1")
        load = weight_bytes / engine_tp / self.copy_rate(gpu)
        if transport == "files":
            write = weight_bytes / self.write_bytes_per_s
            read = engines * weight_bytes / self.read_bytes_per_s   # every engine reads the whole model
            return PushCost(write, read + load + self.fixed_s, read, weight_bytes, weight_bytes, load)
        send = weight_bytes / owners if sharded else weight_bytes
        recv = weight_bytes / engine_tp if sharded else weight_bytes
        # the busier of a sender's link and a receiver's sets the pace (both at wire_bytes_per_s)
        wire = max(send, recv) / self.wire_bytes_per_s + engines * self.per_engine_s
        if staged:   # the wire overlaps generation; the pause is the local copy
            return PushCost(wire, load + self.fixed_s, wire, send, recv, load, True, sharded)
        return PushCost(0.0, wire + load + self.fixed_s, wire, send, recv, load, False, sharded)

    def seconds(self, transport: str, weight_bytes: float, engines: int, engine_tp: int,
                gpu) -> tuple[float, float]:
        """(trainer-side seconds, engine-side seconds) of today's route: unstaged, unsharded."""
        p = self.push(transport, weight_bytes, engines, engine_tp, gpu)
        return p.trainer_s, p.paused_s


def weight_push_s(model, gpu, engines: int, engine_tp: int, transport: str = "collective",
                  sync: WeightSyncCosts | None = None, staged: bool = False, sharded: bool = False,
                  owners: int = 1) -> tuple[float, float]:
    """(trainer-side seconds, paused seconds) of one sync of the model's bf16 weights
    (`WeightSyncCosts.push`); defaults: today's route, unstaged and unsharded."""
    sync = sync or WeightSyncCosts()
    p = sync.push(transport, model.weight_bytes, engines, engine_tp, gpu, staged, sharded, owners)
    return p.trainer_s, p.paused_s
