"""The sender's side of each weight-group backend: how rank 0 meets the engine workers, what
it tells them per bucket, and how it puts a packed bucket on the wire.

- `gloo` (CPU engines): megarl's backend (gloo_backend.py on the engine side): a token-guarded
  TCPStore (group.py), one broadcast of the packed uint8 buffer per bucket.
- `nccl` (GPU engines): vLLM's own `nccl` backend on the engine side, unpacked mode: vLLM's
  trainer-side helper opens the communicator (StatelessProcessGroup rendezvous, no token:
  vLLM's protocol), and each tensor of the bucket goes out as its own NCCL broadcast from the
  packed device buffer's views (no host copy). Needs CUDA; checked by tests/gpu only.
- `ipc` (GPU engines megarl starts on global rank 0's GPU, where NCCL refuses two ranks of one
  communicator): vLLM's own `ipc` backend, unpacked mode. Nothing travels but the update info:
  per tensor a CUDA IPC handle of its view of the packed buffer, which the engine maps and loads
  in place. No group, no rendezvous. vLLM's layerwise reload keeps views of what it loaded until
  each layer is complete, so the engine may read a buffer until `finish_weight_update`: the
  wire `holds_buffers`, and collective.py gives the buffers back to its pool only after the
  finish (the whole model once more on rank 0's GPU during a push, as vLLM's own ipc trainer).

Every wire: `Rendezvous(host, port, world, timeout_s)` (`engine_info(rank_offset)`, `join()`
-> the group, `missing()`), `update_info(meta, buf)` (what each engine's `update_weights`
gets), `send(group, meta, buf, timeout_s)`, `drop(group)`, `holds_buffers`.

Deadlines: `send` returns within `timeout_s` (rollout.engines.timeout_s) or raises. gloo's group
bounds each of its sends and receives itself (group.py); NCCL's calls only enqueue work on a
CUDA stream, which waits for ever on a peer that died, so the nccl wire polls an event recorded
after its broadcasts (`wait_until`) and gives up at the deadline; the caller then drops the
group (ncclCommAbort), which ends the pending broadcast. The sender's session bounds the join
and every send once more (collective.py), whatever the wire.
"""
from __future__ import annotations

import base64
import functools
import pickle
import time
from typing import Callable

import torch
from torch.multiprocessing.reductions import reduce_tensor

from megarl.distributed.env import check_listen
from megarl.rollout.engines.engine import EngineError
from megarl.rollout.weights import group as wgroup
from megarl.rollout.weights import packing

MEMBER_GRACE_S = 30.0


class WireTimeout(EngineError):
    """A wait of the weight wire passed its deadline (an engine died or hung mid-transfer)."""


def wait_until(ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Until `ready()` is true; past `timeout_s` a WireTimeout naming the setting. CUDA has no
    wait with a timeout: the caller's event is polled, sleeping a little longer each time (at
    most 10 ms, against a broadcast of tens of ms or more)."""
    deadline = time.monotonic() + timeout_s
    pause = 1e-4
    while not ready():
        if time.monotonic() >= deadline:
            raise WireTimeout(f"{what} did not complete within {timeout_s:g} s (rollout.engines.timeout_s): an "
                              f"engine died or hung mid-transfer; see the engines' logs, or raise the setting")
        time.sleep(pause)
        pause = min(2 * pause, 0.01)


class GlooRendezvous:
    def __init__(self, host: str, port: int, world: int, timeout_s: float):
        self.host, self.port, self.world, self.timeout_s = host, port, world, timeout_s
        check_listen(host)               # the store below would retry a foreign address until its timeout
        self.token = wgroup.new_token()
        self.store = wgroup.store(host, port, world, timeout_s, sender=True)

    def engine_info(self, rank_offset: int) -> dict:
        # the members wait longer than the sender: when someone is missing, the sender times
        # out first and names who never arrived, instead of a member's timeout blaming itself
        return {"master_address": self.host, "master_port": self.port, "rank_offset": rank_offset,
                "world_size": self.world, "token": self.token,
                "timeout_s": self.timeout_s + min(MEMBER_GRACE_S, self.timeout_s)}

    def join(self):
        return wgroup.join(self.store, 0, self.world, self.token, self.timeout_s)

    def missing(self) -> set[int] | None:
        """Ranks that never recorded their arrival (None: the backend cannot tell)."""
        return set(wgroup.missing_ranks(self.store, self.token, self.world))


class GlooWire:
    name = "gloo"
    Rendezvous = GlooRendezvous
    holds_buffers = False          # a buffer is free again once its broadcast is done
    stages = True                  # the engine side receives into a staging area (staging.py)

    @staticmethod
    def update_info(meta: packing.BucketMeta, buf) -> dict:
        return meta.to_dict()

    @staticmethod
    def send(group, meta: packing.BucketMeta, buf, timeout_s: float) -> None:
        # each send and receive of the chain is bounded by the group's own timeout (the same setting)
        wgroup.broadcast(group, buf if buf.device.type == "cpu" else buf.cpu())

    @staticmethod
    def drop(group) -> None:
        for name in ("abort", "shutdown"):
            if hasattr(group, name):
                try:
                    getattr(group, name)()
                except Exception:  # noqa: BLE001 - best effort on a broken group
                    pass
                return


class NcclRendezvous:
    def __init__(self, host: str, port: int, world: int, timeout_s: float):
        self.host, self.port, self.world, self.timeout_s = host, port, world, timeout_s
        check_listen(host, port)         # vLLM's store is made only in join(): fail here, named

    def engine_info(self, rank_offset: int) -> dict:
        return {"master_address": self.host, "master_port": self.port, "rank_offset": rank_offset,
                "world_size": self.world, "packed": False}

    def join(self):
        # vLLM's trainer-side helper: imported only where a GPU push runs (the trainer has no vLLM otherwise)
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
        return stateless_init_process_group(self.host, self.port, 0, self.world, torch.cuda.current_device())

    def missing(self):
        return None


class NcclWire:
    name = "nccl"
    Rendezvous = NcclRendezvous
    holds_buffers = False
    stages = False                 # vLLM's receiver loads each tensor as it arrives

    @staticmethod
    def update_info(meta: packing.BucketMeta, buf) -> dict:
        return {"names": meta.names, "dtype_names": meta.dtype_names, "shapes": meta.shapes}

    @staticmethod
    def send(group, meta: packing.BucketMeta, buf, timeout_s: float) -> None:
        stream = torch.cuda.current_stream()
        for _, view in packing.unpack(meta, buf):      # the order vLLM's receiver expects
            group.broadcast(view, src=0, stream=stream)
        # not stream.synchronize(): it has no deadline, and a dead peer stalls the stream for ever
        done = torch.cuda.Event()
        done.record(stream)
        wait_until(done.query, timeout_s, f"the NCCL broadcast of a weight bucket ({meta.nbytes} bytes)")

    @staticmethod
    def drop(group) -> None:
        try:
            group.destroy()
        except Exception:  # noqa: BLE001 - best effort on a broken communicator
            pass


class IpcGroup:
    """The ipc wire's "group": nothing to open or close (the handles travel in the update info)."""


class IpcRendezvous:
    """No rendezvous: each engine only learns the wire's mode (vLLM's IPCWeightTransferInitInfo)."""

    def __init__(self, host: str, port: int, world: int, timeout_s: float):
        if not torch.cuda.is_available():
            raise RuntimeError("weight_sync.backend=ipc shares CUDA memory and this process sees no GPU: "
                               "use weight_sync.backend=auto (gloo without a GPU)")
        self.world = world

    def engine_info(self, rank_offset: int) -> dict:
        # unpacked: a handle per tensor (a view of our packed buffer), not vLLM's packed chunks
        return {"packed": False}

    def join(self):
        return IpcGroup()

    def missing(self):
        return None


class IpcWire:
    name = "ipc"
    Rendezvous = IpcRendezvous
    holds_buffers = True           # the engine reads the buffer in place until finish_weight_update
    stages = False                 # vLLM's receiver loads in place from the sender's memory

    @staticmethod
    def update_info(meta: packing.BucketMeta, buf) -> dict:
        """vLLM's IPCWeightTransferUpdateInfo, unpacked: per tensor {GPU UUID: the args of
        torch's rebuild_cuda_tensor} for its view of `buf`, pickled and base64-encoded
        (`ipc_handles_pickled`: JSON-safe, for the in-process client and the HTTP routes alike;
        raw handles hold torch types neither carries). vLLM unpickles it only with
        VLLM_ALLOW_INSECURE_SERIALIZATION=1, which megarl sets on the engines it starts
        (rollout/engines/build.py engine_env); the handles reach them over their control API only,
        behind the API key for servers (rollout/engines/auth.py). The handles keep nothing alive: the
        caller keeps `buf` until the finish (`holds_buffers`)."""
        uuid = gpu_uuid(buf.device)
        handles = [{uuid: reduce_tensor(view)[1]} for _, view in packing.unpack(meta, buf)]
        return {"names": meta.names, "dtype_names": meta.dtype_names, "shapes": meta.shapes,
                "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("ascii")}

    @staticmethod
    def send(group, meta: packing.BucketMeta, buf, timeout_s: float) -> None:
        """Nothing: the engines read the bytes through the handles of `update_info`."""

    @staticmethod
    def drop(group) -> None:
        pass


@functools.lru_cache(maxsize=None)
def _uuid_of(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def gpu_uuid(device: torch.device) -> str:
    """The physical GPU's UUID (what vLLM's ipc receiver looks its handle up by: device indices
    differ between processes with different CUDA_VISIBLE_DEVICES)."""
    return _uuid_of(device.index if device.index is not None else torch.cuda.current_device())


WIRES = {"gloo": GlooWire, "nccl": NcclWire, "ipc": IpcWire}
