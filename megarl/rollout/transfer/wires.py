"""The sender's side of each weight-group backend: how rank 0 meets the engine workers, what
it tells them per bucket, and how it puts a packed bucket on the wire.

- `gloo` (CPU engines): megarl's backend (gloo_backend.py on the engine side): a token-guarded
  TCPStore (group.py), one broadcast of the packed uint8 buffer per bucket.
- `nccl` (GPU engines): vLLM's own `nccl` backend on the engine side, unpacked mode: vLLM's
  trainer-side helper opens the communicator (StatelessProcessGroup rendezvous, no token:
  vLLM's protocol), and each tensor of the bucket goes out as its own NCCL broadcast from the
  packed device buffer's views (no host copy). Needs CUDA; checked by tests/gpu only.
"""
from __future__ import annotations

import torch

from megarl.rollout.transfer import group as wgroup
from megarl.rollout.transfer import packing

MEMBER_GRACE_S = 30.0


class GlooRendezvous:
    def __init__(self, host: str, port: int, world: int, timeout_s: float):
        self.host, self.port, self.world, self.timeout_s = host, port, world, timeout_s
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

    @staticmethod
    def update_info(meta: packing.BucketMeta) -> dict:
        return meta.to_dict()

    @staticmethod
    def send(group, meta: packing.BucketMeta, buf) -> None:
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

    @staticmethod
    def update_info(meta: packing.BucketMeta) -> dict:
        return {"names": meta.names, "dtype_names": meta.dtype_names, "shapes": meta.shapes}

    @staticmethod
    def send(group, meta: packing.BucketMeta, buf) -> None:
        stream = torch.cuda.current_stream()
        for _, view in packing.unpack(meta, buf):      # the order vLLM's receiver expects
            group.broadcast(view, src=0, stream=stream)
        stream.synchronize()

    @staticmethod
    def drop(group) -> None:
        try:
            group.destroy()
        except Exception:  # noqa: BLE001 - best effort on a broken communicator
            pass


WIRES = {"gloo": GlooWire, "nccl": NcclWire}
