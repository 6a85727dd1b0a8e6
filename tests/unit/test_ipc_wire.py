"""weight_sync.backend=ipc without a GPU: which backend `auto` resolves to for each engine mode,
the settings refused (each naming the setting, its value and the fix), the environment of the
engines megarl starts, and the ipc wire's update info as vLLM's own ipc receiver reads it
(CUDA's handle export and the GPU's UUID faked; every other step is vLLM's and megarl's code).

The holding of packed buffers until the finish is pinned in test_weight_transfer.py over real
gloo groups; the push into a CUDA engine on the trainer's GPU is tests/gpu/test_weight_transfer_gpu.py."""
import json

import pytest
import torch

from megarl import preflight
from megarl.config import ConfigError, load_config
from megarl.config.schema import WeightSyncConfig
from megarl.models.arch import resolve_arch
from megarl.plan import make_plan
from megarl.plan import memory as mem
from megarl.rollout.engines import build
from megarl.rollout.weights import packing, wires

INSECURE = "VLLM_ALLOW_INSECURE_SERIALIZATION"
TINY = "recipes/tiny_cpu.yaml"
R7 = "recipes/qwen2.5_7b.yaml"
REMOTE = ["rollout.engines.mode=remote", "rollout.engines.urls=[http://127.0.0.1:8000]"]


# -- which backend ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode,cuda,want", [
    ("inprocess", False, "gloo"), ("local_servers", False, "gloo"), ("remote", False, "gloo"),
    ("inprocess", True, "ipc"), ("local_servers", True, "ipc"), ("remote", True, "nccl")])
def test_auto_is_gloo_on_cpu_ipc_for_engines_megarl_starts_and_nccl_for_remote_ones(mode, cuda, want):
    assert WeightSyncConfig().resolved_backend(cuda, mode) == want
    for explicit in ("gloo", "nccl"):                  # an explicit choice is kept
        assert WeightSyncConfig(backend=explicit).resolved_backend(cuda, mode) == explicit


def test_ipc_with_remote_engines_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match=r"weight_sync\.backend='ipc': needs engines megarl starts .*"
                                          r"rollout\.engines\.mode=remote.*use weight_sync\.backend=nccl"):
        load_config(TINY, ["weight_sync.backend=ipc", *REMOTE])
    with pytest.raises(ConfigError, match="rollout.engines.mode=remote"):
        build.weight_backend(WeightSyncConfig(backend="ipc"), "remote")   # what `serve` asks for
    # files: the backend is unused, so it is refused as such; auto with remote engines is nccl
    with pytest.raises(ConfigError, match=r"weight_sync\.backend='ipc': is not used with weight_sync\.transport=files"):
        load_config(TINY, ["weight_sync.backend=ipc", "weight_sync.transport=files", *REMOTE])
    assert load_config(TINY, REMOTE).weight_sync.resolved_backend(True, "remote") == "nccl"


def test_ipc_with_engine_tp_above_1_is_refused_at_load_and_auto_once_cuda_is_known(monkeypatch):
    with pytest.raises(ConfigError, match=r"weight_sync\.backend='ipc': cannot serve engines of rollout\.engines\."
                                          r"tp=2: global rank 0 exports CUDA IPC handles of its own GPU only.*"
                                          r"use rollout\.engines\.tp=1"):
        load_config(TINY, ["weight_sync.backend=ipc", "rollout.engines.tp=2"])
    cfg = load_config(TINY, ["rollout.engines.tp=2"])        # auto: no CUDA known at load
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)   # no GPU left to the engines: rank 0's (ipc)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for var, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=r"weight_sync\.backend='auto': resolves to ipc here \(CUDA, engines "
                                          r"megarl starts\), which cannot serve engines of rollout\.engines\.tp=2"):
        preflight.check_backends(cfg)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)   # one GPU left, a TP=2 engine: too few
    with pytest.raises(ConfigError, match=r"1 engines x rollout\.engines\.tp=2 need 2 GPUs of their own"):
        preflight.check_backends(cfg)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    preflight.check_backends(load_config(TINY, ["rollout.engines.tp=2", "weight_sync.transport=files"]))
    preflight.check_backends(load_config(TINY, []))          # TP=1: ipc serves it


def test_ipc_without_a_gpu_is_refused_by_the_preflight(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"weight_sync\.backend='ipc' needs GPUs and this machine shows none: "
                                          r"use weight_sync\.backend=auto"):
        preflight.check_backends(load_config(TINY, ["weight_sync.backend=ipc"]))


# -- the engines megarl starts ---------------------------------------------------------------
@pytest.mark.parametrize("mode", ["inprocess", "local_servers"])
def test_engines_started_for_ipc_allow_vllm_to_unpickle_the_handles(mode, tmp_path):
    """The in-process engine sets it while vLLM spawns its engine core (inherited by the
    workers); a local server gets it in its environment. Not for the other backends."""
    cfg = load_config(TINY, [f"rollout.engines.mode={mode}"])
    for backend, want in (("ipc", "1"), ("gloo", None), ("nccl", None)):
        engine = build.build_engine(cfg.rollout, "model", 0, str(tmp_path), 0, backend)
        env = engine.env if mode == "inprocess" else engine.server.env()
        assert env.get(INSECURE) == want
        settings = engine.engine_args if mode == "inprocess" else engine.server.settings()
        assert settings["weight_transfer_config"] == {"backend": backend}


# -- the update info -------------------------------------------------------------------------
EXPORTED: dict[bytes, torch.Tensor] = {}     # fake CUDA IPC handle -> the buffer it maps


def fake_reduce_tensor(t):
    """torch's CUDA export, positions and all (reductions.reduce_tensor), with a made-up
    handle: the tensor's own size, stride, offset in its storage and dtype."""
    handle = f"handle-{t.untyped_storage().data_ptr()}".encode()
    EXPORTED[handle] = t
    return None, (type(t), t.size(), t.stride(), t.storage_offset(), torch.UntypedStorage, t.dtype, 0,
                  handle, t.untyped_storage().nbytes(), 0, t.requires_grad, b"ref", 0, b"event", True)


def fake_rebuild_cuda_tensor(tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, *rest):
    """What the engine gets: a tensor over the exporter's storage at the exported offset."""
    REBUILT_ON.append(device)
    return torch.empty(0, dtype=dtype).set_(EXPORTED[handle].untyped_storage(), offset, size, stride)


REBUILT_ON: list = []


class Props:
    uuid = "GPU-5e1f-fake"


class LoadingModel:
    def __init__(self):
        self.loaded = {}

    def load_weights(self, weights):
        self.loaded.update({n: t.clone() for n, t in weights})


@pytest.fixture
def faked_cuda(monkeypatch):
    monkeypatch.setattr(wires, "reduce_tensor", fake_reduce_tensor)
    monkeypatch.setattr(wires, "gpu_uuid", lambda device: Props.uuid)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    EXPORTED.clear()
    REBUILT_ON.clear()


def named_tensors():
    return [("a.weight", torch.arange(12, dtype=torch.float32).view(3, 4)),
            ("b.bias", torch.arange(5, dtype=torch.bfloat16)),
            ("c.half", torch.arange(6, dtype=torch.float16).view(1, 2, 3)),
            ("d.scalar", torch.tensor(2.5))]


def test_ipc_update_info_is_json_and_vllms_receiver_loads_exactly_the_packed_tensors(faked_cuda, monkeypatch):
    """Per tensor a {GPU UUID: rebuild args} handle of its view of the packed buffer, pickled as
    `ipc_handles_pickled`: JSON-safe (the HTTP routes, the in-process client), parsed by vLLM's
    IPCWeightTransferUpdateInfo only with VLLM_ALLOW_INSECURE_SERIALIZATION=1, and vLLM's
    receiver (unpacked mode, as `engine_info` tells it) loads the trainer's tensors exactly."""
    ipc_engine = pytest.importorskip("vllm.distributed.weight_transfer.ipc_engine")
    named = named_tensors()
    meta, buf = packing.pack(named, out=torch.zeros(4096, dtype=torch.uint8))   # a pooled, larger buffer
    info = json.loads(json.dumps(wires.IpcWire.update_info(meta, buf)))
    assert set(info) == {"names", "dtype_names", "shapes", "ipc_handles_pickled"}
    assert info["names"] == [n for n, _ in named] and info["shapes"] == [[3, 4], [5], [1, 2, 3], []]

    monkeypatch.delenv(INSECURE, raising=False)
    with pytest.raises(ValueError, match=INSECURE):
        ipc_engine.IPCWeightTransferUpdateInfo(**info)
    monkeypatch.setenv(INSECURE, "1")
    parsed = ipc_engine.IPCWeightTransferUpdateInfo(**info)
    assert isinstance(parsed.ipc_handles, list) and len(parsed.ipc_handles) == len(named)
    assert all(list(h) == [Props.uuid] for h in parsed.ipc_handles)

    receiver = object.__new__(ipc_engine.IPCWeightTransferEngine)
    receiver.init_transfer_engine(receiver.init_info_cls(**object.__new__(wires.IpcRendezvous).engine_info(1)))
    assert receiver.packed is False
    receiver.device, receiver.model = torch.device("cuda", 3), LoadingModel()
    monkeypatch.setattr(ipc_engine, "rebuild_cuda_tensor", fake_rebuild_cuda_tensor)
    receiver.receive_weights(receiver.parse_update_info(info))
    assert REBUILT_ON == [3] * len(named)              # on the receiver's own device index
    assert list(receiver.model.loaded) == [n for n, _ in named]
    for name, want in named:
        got = receiver.model.loaded[name]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_ipc_wire_has_no_group_and_holds_its_buffers():
    assert wires.WIRES["ipc"] is wires.IpcWire and wires.IpcWire.holds_buffers
    assert not wires.GlooWire.holds_buffers and not wires.NcclWire.holds_buffers
    meet = object.__new__(wires.IpcRendezvous)
    assert meet.engine_info(5) == {"packed": False} and meet.missing() is None
    group = meet.join()
    wires.IpcWire.send(group, None, None, 30)             # nothing goes on a wire
    wires.IpcWire.drop(group)


# -- the plan ----------------------------------------------------------------------------------
def test_plan_counts_the_whole_model_on_global_rank_0_and_nothing_on_the_engines_with_ipc():
    """Engines on the trainer's node (cluster.engine_nodes=0, local_servers): auto is ipc, and
    rank 0's GPU holds the model once more + the pool's buffers; with engine nodes of their
    own the engines are remote to the trainer: nccl, and ipc is refused."""
    local = ["cluster.engine_nodes=0", "cluster.trainer_nodes=0", "cluster.nodes=1"]
    ipc = make_plan(load_config(R7, local))
    files = make_plan(load_config(R7, local + ["weight_sync.transport=files"]))
    cfg = load_config(R7, local)
    arch = resolve_arch(cfg)[0]
    ws = cfg.weight_sync
    held = mem.total_params(arch) * 2 + mem.transfer_buffer_bytes(arch, ws.bucket_mb, ws.num_buffers, 2)
    assert ipc["per_gpu_bytes"]["weight_transfer"] == held
    assert ipc["trainer"]["sender_peak_bytes"] - files["trainer"]["sender_peak_bytes"] == held
    assert "whole model" in ipc["weight_transfer"] and any("backend=ipc" in n for n in ipc["notes"])
    assert make_plan(load_config(R7, []))["engine"]["transfer_bytes"] > 0    # engine nodes: nccl
    with pytest.raises(ConfigError, match=r"cluster\.engine_nodes=1 puts the engines on nodes of their own"):
        make_plan(load_config(R7, ["weight_sync.backend=ipc"]))
