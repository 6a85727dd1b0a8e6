"""The engine side of an adapters push (weight_sync.lora=adapters): megarl's gloo backend receives
adapter buckets over a real gloo weight group without touching the model (no load, no
layerwise reload) and hands them to the swap once; the swap (rollout/engines/lora_slots.py)
builds vLLM's own LoRAModel from them in memory and replaces the engine's adapter under the same
id. vLLM's LoRA model manager is a recording stand-in here (its real use: tests/e2e/test_lora_push.py)."""
import threading
import types

import pytest
import torch
from test_staging import Model

from megarl.distributed.env import free_port
from megarl.rollout.engines import lora_slots
from megarl.rollout.engines.engine import EngineError
from megarl.rollout.weights import gloo_backend, group, packing

TIMEOUT_S = 10.0
SPEC = {"id": 1, "name": "megarl-lora", "r": 4, "alpha": 8.0}
P = "base_model.model.model.layers.0."


def peft_tensors(seed=0, r=4):
    g = torch.Generator().manual_seed(seed)
    return {P + "self_attn.q_proj.lora_A.weight": torch.randn(r, 16, generator=g),
            P + "self_attn.q_proj.lora_B.weight": torch.randn(16, r, generator=g),
            P + "mlp.down_proj.lora_A.weight": torch.randn(r, 32, generator=g),
            P + "mlp.down_proj.lora_B.weight": torch.randn(16, r, generator=g)}


@pytest.fixture
def reload_hooks(monkeypatch):
    from vllm.model_executor.model_loader import reload
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda model: model.events.append("init"))
    monkeypatch.setattr(reload, "finalize_layerwise_reload", lambda model, cfg: model.events.append("final"))


def unstaged_worker():
    """A worker (rank 1) of a new unstaged gloo group and its sender (rank 0)."""
    port, token = free_port(), group.new_token()
    store = group.store("127.0.0.1", port, 2, TIMEOUT_S, sender=True)
    box = {}
    joiner = threading.Thread(target=lambda: box.update(g=group.join(store, 0, 2, token, TIMEOUT_S)))
    joiner.start()
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
                                   model_config=None)
    engine = gloo_backend.GlooWeightTransferEngine(None, config, torch.device("cpu"), Model())
    engine.init_transfer_engine(gloo_backend.GlooInitInfo(master_address="127.0.0.1", master_port=port, rank_offset=1,
                                                          world_size=2, token=token, timeout_s=TIMEOUT_S))
    joiner.join()
    return engine, box["g"], store


def push(engine, sender, buckets, adapter):
    """One unstaged session: each bucket's receive (the worker) beside its broadcast (the sender)."""
    engine.start_weight_update()
    for named in buckets:
        meta, buf = packing.pack(named)
        info = meta.to_dict() | ({"adapter": adapter} if adapter else {})
        t = threading.Thread(target=group.broadcast, args=(sender, buf))
        t.start()
        engine.update_weights(info)
        t.join(TIMEOUT_S)
    engine.finish_weight_update()


def test_adapter_buckets_are_kept_for_the_swap_and_never_loaded(reload_hooks):
    engine, sender, _store = unstaged_worker()
    tensors = peft_tensors()
    items = sorted(tensors.items())
    push(engine, sender, [items[:2], items[2:]], SPEC)
    assert engine.model.events == [] and engine.model.loaded == {}   # no load, no layerwise reload
    got, spec = engine.take_adapter()
    assert spec == SPEC and set(got) == set(tensors)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    assert engine.take_adapter() is None                             # handed over once
    # a full push after it still loads inside one layerwise reload, and leaves no adapter
    weights = [("layers.0.w", torch.ones(3, 4))]
    push(engine, sender, [weights], None)
    assert engine.model.events == ["init", "load", "final"] and torch.equal(engine.model.loaded["layers.0.w"],
                                                                            torch.ones(3, 4))
    assert engine.take_adapter() is None
    engine.shutdown()


class Manager:
    """vLLM's LoRA model manager as the swap uses it: its config and the three calls, recorded."""

    def __init__(self, max_rank=8):
        self.lora_config = types.SimpleNamespace(max_lora_rank=max_rank, lora_dtype=torch.float32)
        self.calls, self.registered = [], {}

    def remove_adapter(self, i):
        self.calls.append(("remove", i))
        self.registered.pop(i, None)

    def add_adapter(self, lora):
        self.calls.append(("add", lora.id))
        self.registered[lora.id] = lora

    def activate_adapter(self, i):
        self.calls.append(("activate", i))


def test_swap_builds_vllms_lora_model_and_replaces_the_adapter_under_its_id():
    manager = Manager()
    model = types.SimpleNamespace(lora_manager=manager)
    first, second = peft_tensors(0), peft_tensors(1)
    lora_slots.swap(model, first, SPEC)
    lora_slots.swap(model, second, SPEC)
    assert manager.calls == [("remove", 1), ("add", 1), ("activate", 1)] * 2
    lora = manager.registered[1]
    assert lora.rank == 4 and set(lora.loras) == {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"}
    q = lora.get_lora("model.layers.0.self_attn.q_proj")
    assert q.scaling == 2.0                                          # alpha / r
    assert torch.equal(q.lora_a, second[P + "self_attn.q_proj.lora_A.weight"])
    assert torch.equal(q.lora_b, second[P + "self_attn.q_proj.lora_B.weight"])
    second[P + "self_attn.q_proj.lora_A.weight"].zero_()             # the received buffers are reused:
    assert q.lora_a.abs().sum() > 0                                  # the adapter holds its own copies


def test_swap_refuses_what_the_engine_cannot_serve():
    with pytest.raises(ValueError, match="greater than max_lora_rank 8"):
        lora_slots.swap(types.SimpleNamespace(lora_manager=Manager(8)), peft_tensors(r=16), {**SPEC, "r": 16})
    with pytest.raises(RuntimeError, match=r"started without LoRA \(vLLM's enable_lora\).*--enable-lora"):
        lora_slots.swap(types.SimpleNamespace(), peft_tensors(), SPEC)
    lora_slots.check_swapped([1, "1"], "e")                          # HTTP answers are strings
    with pytest.raises(EngineError, match=r"engine e: the adapters push reached the workers as \[1, 0\]"):
        lora_slots.check_swapped([1, 0], "e")
