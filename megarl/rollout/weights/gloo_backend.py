"""megarl's `gloo` backend for vLLM's weight-transfer API: the engine side, inside every vLLM
worker process (loaded by `plugin.register`, the `vllm.general_plugins` entry point).

vLLM's own `nccl` backend does nothing useful without CUDA (its communicator disables itself:
the update "succeeds" and the old weights stay), so CPU engines receive over gloo instead,
with the same session and the same roles: the trainer's sender is rank 0 of a stateless group,
this worker is `dp_rank * TP * PP + worker rank + rank_offset`. Each `update_weights` call is one
bucket: `BucketMeta` describes a packed uint8 buffer; the worker receives it with one broadcast
and loads its views with `model.load_weights` while the next bucket arrives (the last one in
`finish_weight_update`), inside vLLM's layerwise reload (started in
`start_weight_update`, finalized in `finish_weight_update`), which also refreshes the
oneDNN-repacked copies the CPU backend keeps of linear weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from megarl.rollout.weights import group, packing


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int                   # this engine's first worker's rank in the group
    world_size: int                    # the sender + every worker of every engine
    token: str                         # the group's key prefix (group.py)
    timeout_s: float = 300.0           # joining, and each broadcast


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list
    dtype_names: list
    shapes: list
    offsets: list
    nbytes: int


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = None
        self.rank = -1
        self.pending = None              # the bucket received last, loaded with the next one
        self.buffers = packing.ReceiveBuffers()   # reused once vLLM holds no view of them

    def init_transfer_engine(self, info: GlooInitInfo) -> None:
        pc = self.parallel_config
        worker = pc.data_parallel_index * pc.world_size + pc.rank
        self.shutdown()                  # a re-formed group replaces the old one
        self.rank = worker + info.rank_offset
        store = group.store(info.master_address, info.master_port, info.world_size, info.timeout_s,
                            sender=False)
        self.group = group.join(store, self.rank, info.world_size, info.token, info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        self.pending = None
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        self._load_pending()
        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # the base class ends with torch.accelerator.synchronize(), which fails without one
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, info: GlooUpdateInfo) -> None:
        """Receive this bucket while the previous one loads: the wire and the engine's own
        load overlap (the last bucket loads in finish_weight_update). The receive is this
        worker's part of the chain broadcast (group.start_broadcast): it forwards each chunk to
        the next member as it arrives. The buffer is a kept one that no view of an earlier
        bucket still uses (packing.ReceiveBuffers), else a new one."""
        if self.group is None:
            raise RuntimeError("megarl gloo weight transfer: init_weight_transfer_engine was not called")
        meta = packing.BucketMeta(list(info.names), list(info.dtype_names), [list(s) for s in info.shapes],
                                  list(info.offsets), int(info.nbytes))
        buf = self.buffers.take(meta.nbytes)
        work = group.start_broadcast(self.group, buf)
        try:
            self._load_pending()
        finally:
            work.wait()
        self.pending = (meta, buf)

    def _load_pending(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            self.model.load_weights(packing.unpack(*pending))

    def shutdown(self) -> None:
        self.group = None                # gloo closes its pairs when the group is collected
        self.buffers.clear()
