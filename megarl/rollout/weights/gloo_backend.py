"""megarl's `gloo` backend for vLLM's weight-transfer API: the engine side, inside every vLLM
worker process (loaded by `plugin.register`, the `vllm.general_plugins` entry point).

vLLM's own `nccl` backend does nothing useful without CUDA (its communicator disables itself:
the update "succeeds" and the old weights stay), so CPU engines receive over gloo instead,
with the same session and the same roles: the trainer's sender is rank 0 of a stateless group,
this worker is `dp_rank * TP * PP + worker rank + rank_offset`. Each `update_weights` call is one
bucket: `BucketMeta` describes a packed uint8 buffer; the worker receives it with one broadcast
and loads its views with `model.load_weights` while the next bucket arrives (the last one in
`finish_weight_update`), inside vLLM's layerwise reload (opened before the first load,
finalized in `finish_weight_update`), which also refreshes the oneDNN-repacked copies the CPU
backend keeps of linear weights.

Adapters (`GlooUpdateInfo.adapter`, weight_sync.lora=adapters: rollout/weights/adapters.py):
the buckets are LoRA adapters in PEFT names; they are kept, not loaded into the model, and
the engine client's call of the worker method `lora_slots.SWAP` after `finish_weight_update`
swaps them into vLLM's LoRA slot (`take_adapter`). The base weights are not touched, so no
layerwise reload is opened.

Staged (`GlooInitInfo.staged`, weight_sync.staged): `update_weights` only queues the bucket for
the worker's staging area (staging.py), whose thread receives it while the engine generates;
`start_weight_update` opens the area and `finish_weight_update`, called with the engine paused,
loads every staged bucket inside one layerwise reload: the pause is the local load only.

Prepared staging (unquantized models: shadow.py): each staged bucket is queued, as it arrives,
for a shadow of the model's layers; the worker method `engines/staged_swap.READY`, which the
sender polls before pausing the engines, loads into the shadow for a slice of time on the
engine's thread and answers whether it is complete. `finish_weight_update` then only swaps the
prepared tensors in: the pause no longer holds the load.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from megarl.rollout.weights import group, packing, shadow
from megarl.rollout.weights.pieces import PieceMeta
from megarl.rollout.weights.staging import ShardedStaging, StagingArea, StagingError

# a staged version's load into the shadow, per readiness poll (on the engine's thread, between its
# model steps): long enough that the poll's own cost is small beside it, short beside a step
PREPARE_SLICE_S = 0.05


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int                   # this engine's first worker's rank in the group
    world_size: int                    # the sender + every worker of every engine
    token: str                         # the group's key prefix (group.py)
    timeout_s: float = 300.0           # joining, and each broadcast
    staged: bool = False               # receive into a staging area while the engine generates
    # a sharded push (weight_sync.sharded): the group's ranks 0 .. senders-1 are trainer ranks,
    # each sending the pieces of HF tensors its own shards cover (pieces.py); 1: rank 0 sends all
    senders: int = 1


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    # one packed bucket from rank 0 ...
    names: list | None = None
    dtype_names: list | None = None
    shapes: list | None = None
    offsets: list | None = None
    nbytes: int = 0
    # ... or, sharded: every piece bucket (pieces.PieceMeta dicts) of trainer sender `sender`
    sender: int = -1
    pieces: list | None = None
    # LoRA adapters to swap in (adapters.spec: id, name, r, alpha), not weights to load
    adapter: dict | None = None


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = None
        self.rank = -1
        self.pending = None              # the bucket received last, loaded with the next one
        self.buffers = packing.ReceiveBuffers()   # reused once vLLM holds no view of them
        self.staged = False
        self.timeout_s = 300.0
        self.staging: StagingArea | ShardedStaging | None = None   # the open staged session's area
        self.shadow: shadow.Shadow | None = None   # its version, prepared beside the model (shadow.py)
        # a staged push keeps every bucket until the swap: all of them are reused next push
        self.staging_buffers = packing.ReceiveBuffers(keep=1 << 16)
        self.senders = 1
        self.staged_tensors: dict = {}  # a sharded push's full tensors, reused by the next one
        self.sender_buffers: list[packing.ReceiveBuffers] = []
        self.reloading = False           # this session opened vLLM's layerwise reload
        self.adapter: dict | None = None  # this session's adapter spec and tensors (an adapters push)
        self.adapter_tensors: dict = {}
        self.adapter_ready: tuple | None = None   # the finished session's (tensors, spec), until swapped in

    def init_transfer_engine(self, info: GlooInitInfo) -> None:
        pc = self.parallel_config
        worker = pc.data_parallel_index * pc.world_size + pc.rank
        self.shutdown()                  # a re-formed group replaces the old one
        self.staged, self.timeout_s = bool(info.staged), float(info.timeout_s)
        self.senders = int(info.senders)
        if self.senders > 1 and not self.staged:
            raise ValueError("megarl gloo weight transfer: a sharded push (senders > 1) must be staged")
        self.sender_buffers = [packing.ReceiveBuffers() for _ in range(self.senders)]
        self.rank = worker + info.rank_offset
        store = group.store(info.master_address, info.master_port, info.world_size, info.timeout_s,
                            sender=False)
        self.group = group.join(store, self.rank, info.world_size, info.token, info.timeout_s)

    def start_weight_update(self) -> None:
        self.pending = None
        self.adapter, self.adapter_tensors = None, {}
        if self.staged:                  # nothing touches the model until the swap
            self._abandon_staging()
            prepared = self.shadow = (shadow.Shadow(self.model) if shadow.supported(self.model_config) else None)
            if self.senders > 1:
                self.staging = ShardedStaging(self.group, self.senders, self.staged_tensors, self.sender_buffers)
            else:                        # each bucket queued for the shadow as it arrives
                load = (lambda meta, buf: prepared.feed(packing.unpack(meta, buf))) if prepared else None
                self.staging = StagingArea(self.group, self.staging_buffers, on_bucket=load)
            return
        # the layerwise reload opens at the first load (_load_pending): an adapters push loads none
        self.reloading = False

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        if self.staged:
            staging, self.staging = self.staging, None
            if staging is None or staging.abandoned:
                return                   # a session given up on (engine.py STALE_SESSION): load nothing
            prepared, self.shadow = self.shadow, None
            if prepared is not None:     # the swap only: prepared while the engine generated
                staging.prepare(self._then(prepared))   # (asked for already where the sender polled)
                staging.wait_prepared(self.timeout_s)   # raises, touching nothing, if a receive failed
                staging.take(self.timeout_s)
                try:
                    prepared.swap()      # loads what the polls left, then swaps; raises, touching nothing
                except shadow.ShadowError as err:
                    raise StagingError(str(err)) from err
                return
            staged = staging.take(self.timeout_s)   # raises, loading nothing, if a receive failed
            initialize_layerwise_reload(self.model)
            if isinstance(staging, ShardedStaging):
                self.model.load_weights(list(staged.items()))
            else:
                for meta, buf in staged:
                    self.model.load_weights(packing.unpack(meta, buf))
            finalize_layerwise_reload(self.model, self.model_config)
            return
        self._load_pending()
        if self.adapter is not None:     # swapped in by the worker method lora_slots.SWAP, after vLLM
            # ends the session (it drops every registered adapter then)
            self.adapter_ready = (self.adapter_tensors, self.adapter)
            self.adapter, self.adapter_tensors = None, {}
        if self.reloading:
            self.reloading = False
            finalize_layerwise_reload(self.model, self.model_config)

    def staged_ready(self) -> bool:
        """Whether the open staged session's version is ready for the swap (a failed one too:
        the swap raises it). The sender calls this (engines/staged_swap.READY) once its last
        bucket is on the wire, again and again until true: each call, on the engine's thread
        between model steps, loads into the shadow for up to PREPARE_SLICE_S."""
        staging, prepared = self.staging, self.shadow
        if staging is None or staging.abandoned:
            return True
        staging.prepare(self._then(prepared))
        if prepared is None:
            return staging.prepared()
        if staging.prepared() and staging.error is not None:
            return True
        ready = prepared.advance(PREPARE_SLICE_S)
        return ready and staging.prepared()

    def _then(self, prepared):
        """What ends a session's receives, on the staging thread: the shadow told that nothing
        more comes (sharded: fed the assembled tensors first); nothing without a shadow."""
        if prepared is None:
            return None
        if self.senders > 1:
            def feed_all(tensors):
                prepared.feed(list(tensors.items()))
                prepared.complete()
            return feed_all
        return lambda _buckets: prepared.complete()

    def take_adapter(self) -> tuple | None:
        """The last finished session's adapter (PEFT tensors, spec), once; None if it had none."""
        ready, self.adapter_ready = self.adapter_ready, None
        return ready

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
        if info.pieces is not None:      # sharded: every piece bucket of one sender
            if not isinstance(self.staging, ShardedStaging):
                raise RuntimeError("megarl gloo weight transfer: piece buckets arrived outside a sharded session")
            self.staging.receive(int(info.sender), [PieceMeta.from_dict(d) for d in info.pieces])
            return
        meta = packing.BucketMeta(list(info.names), list(info.dtype_names), [list(s) for s in info.shapes],
                                  list(info.offsets), int(info.nbytes))
        if info.adapter is not None and self.staged:
            raise RuntimeError("megarl gloo weight transfer: adapters arrive unstaged (rollout/weights/adapters.py)")
        if self.staged:
            if self.staging is None:
                raise RuntimeError("megarl gloo weight transfer: a staged bucket arrived outside a session")
            self.staging.receive(meta)   # returns at once: the engine goes on generating
            return
        buf = self.buffers.take(meta.nbytes)
        work = group.start_broadcast(self.group, buf)
        try:
            self._load_pending()
        finally:
            work.wait()
        self.pending = (meta, buf, info.adapter)

    def _load_pending(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        pending, self.pending = self.pending, None
        if pending is None:
            return
        meta, buf, adapter = pending
        if adapter is not None:          # kept for the swap at the finish (views: copied there)
            self.adapter = adapter
            self.adapter_tensors.update(packing.unpack(meta, buf))
            return
        if not self.reloading:
            initialize_layerwise_reload(self.model)
            self.reloading = True
        self.model.load_weights(packing.unpack(meta, buf))

    def _abandon_staging(self) -> None:
        staging, self.staging = self.staging, None
        self.shadow = None
        if staging is not None:
            staging.abandon()

    def shutdown(self) -> None:
        self._abandon_staging()
        self.group = None                # gloo closes its pairs when the group is collected
        self.buffers.clear()
