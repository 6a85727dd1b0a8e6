"""The next version prepared beside the live model (rollout/weights/shadow.py), on a small
torch model built as vLLM builds one: parameters with their own weight loaders (a fused
projection loaded shard by shard, a bias, a padded embedding whose head shares its weight),
a projection whose weight is vLLM's own parameter class (its loader a property), a quant
method whose processing replaces the weight by a repacked copy (as the CPU backend's oneDNN
handle does), and vLLM's own recorded metadata and layerwise processing. The stand-in is
the model only: the reload machinery is vLLM's.

The contract: loading into the shadow never writes the live model (it is generating); the swap
leaves the live model exactly as vLLM's in-place reload of the same weights leaves it, keeps
its tensor objects (captured graphs and kernel configs hold them), and a failed load leaves the
live model and its loaders as they were."""
import threading
import types

import pytest
import torch
from torch import nn

from megarl.distributed.env import free_port
from megarl.rollout.weights import gloo_backend, group, packing, shadow

pytest.importorskip("vllm")

from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase  # noqa: E402
from vllm.model_executor.model_loader import reload  # noqa: E402
from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading  # noqa: E402
from vllm.model_executor.parameter import ModelWeightParameter  # noqa: E402

H, SHARDS, VOCAB, PADDED = 4, 3, 6, 8


class Repack(QuantizeMethodBase):
    """Processing as the CPU backend's: the weight becomes a packed copy held outside the
    layer's tensors (`packed`), and the weight an empty tensor."""

    def create_weights(self, *args, **kwargs):
        pass

    def apply(self, layer, x):
        return x @ layer.packed.t() + layer.bias

    def process_weights_after_loading(self, layer):
        layer.packed = layer.weight.detach().flip(0).contiguous() * 2
        layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)


class RepackKeeping(Repack):
    """Processing that keeps the weight as it is (as on a GPU): the live weight stays vLLM's
    parameter class, its loader a property."""

    def process_weights_after_loading(self, layer):
        layer.packed = layer.weight.detach().flip(0).contiguous() * 2


class Fused(nn.Module):
    """A projection loaded shard by shard (as q, k, v into qkv)."""

    def __init__(self):
        super().__init__()
        self.quant_method = Repack()
        self.weight = nn.Parameter(torch.zeros(SHARDS * H, H), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = nn.Parameter(torch.zeros(SHARDS * H), requires_grad=False)
        self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard: int):
        param.data.narrow(0, shard * H, H).copy_(loaded)


class Row(nn.Module):
    """A projection whose weight is vLLM's parameter class: `weight_loader` is a property there
    (held in `_weight_loader`), which both the redirect and the shadow's copy must go through.
    Built without its __init__, which asks for a tensor-parallel group."""

    def __init__(self):
        super().__init__()
        self.quant_method = RepackKeeping()
        weight = ModelWeightParameter.__new__(ModelWeightParameter, data=torch.zeros(H, SHARDS * H))
        weight._weight_loader = self.weight_loader
        self.weight = weight
        self.bias = nn.Parameter(torch.zeros(H), requires_grad=False)

    def weight_loader(self, param, loaded):
        param.data.copy_(loaded)


class Embed(nn.Module):
    """A vocabulary padded past the checkpoint's rows (loaded: VOCAB of PADDED)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(PADDED, H), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded):
        param.data[:VOCAB].copy_(loaded)


class Head(nn.Module):
    def __init__(self, embed: Embed):
        super().__init__()
        self.weight = embed.weight                # tied, as vLLM ties lm_head


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = Embed()
        self.fused = Fused()
        self.row = Row()
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.zeros(H), requires_grad=False)   # vLLM's default loader
        self.head = Head(self.embed)

    def load_weights(self, weights):
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader
        params = dict(self.named_parameters(remove_duplicate=False))
        for name, tensor in weights:
            if name in ("q", "k", "v"):
                param = params["fused.weight"]
                param.weight_loader(param, tensor, "qkv".index(name))
            elif name.startswith("bias."):
                param = params["fused.bias"]
                param.weight_loader(param, tensor, int(name[5:]))
            else:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)


def hf(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = [(n, torch.randn(H, H, generator=g)) for n in ("q", "k", "v")]
    out += [(f"bias.{i}", torch.randn(H, generator=g)) for i in range(SHARDS)]
    out += [("row.weight", torch.randn(H, SHARDS * H, generator=g)), ("row.bias", torch.randn(H, generator=g))]
    return out + [("norm.weight", torch.randn(H, generator=g)), ("embed.weight", torch.randn(VOCAB, H, generator=g))]


def built(seed: int = 0) -> Model:
    """A model after vLLM's first load: metadata recorded, weights loaded, then processed."""
    m = Model()
    record_metadata_for_reloading(m)
    m.load_weights(hf(seed))
    for layer in (m.fused, m.row):
        layer.quant_method.process_weights_after_loading(layer)
    return m


def in_place(m: Model, weights) -> None:
    """vLLM's own reload of the live model (what the engine did in the pause before)."""
    reload.initialize_layerwise_reload(m)
    m.load_weights(weights)
    reload.finalize_layerwise_reload(m, types.SimpleNamespace(dtype=torch.float32))


def state(m: Model) -> dict:
    """What the model computes with."""
    return {"packed": m.fused.packed.clone(), "bias": m.fused.bias.detach().clone(),
            "row": m.row.packed.clone(), "row_bias": m.row.bias.detach().clone(),
            "norm": m.norm.weight.detach().clone(), "embed": m.embed.weight.detach()[:VOCAB].clone(),
            "head": m.head.weight.detach()[:VOCAB].clone()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_shadow_swap_equals_vllms_in_place_reload_and_the_live_model_is_untouched_until_it():
    live, reference = built(), built()
    in_place(reference, hf(1))
    before = state(live)
    objects = {n: id(p) for n, p in live.named_parameters()}
    s = shadow.Shadow(live)
    for name, tensor in hf(1):                 # one bucket per tensor, as the staging thread loads
        s.load([(name, tensor)])
        assert same(state(live), before)       # generating with the old version
    s.finish()
    assert same(state(live), before)
    s.swap()
    assert same(state(live), state(reference)) and not same(state(live), before)
    assert {n: id(p) for n, p in live.named_parameters()} == objects   # the same tensor objects
    assert live.head.weight is live.embed.weight


def test_shadow_swaps_and_in_place_reloads_alternate_without_drift():
    """vLLM's recorded metadata is shared by every reload: a shadow must not bend it for the next
    in-place reload (an unstaged push) nor take an earlier reload's wrappers for its own."""
    live, reference = built(), built()
    for seed, staged in ((1, True), (2, False), (3, True), (4, True)):
        if staged:
            s = shadow.Shadow(live)
            s.load(hf(seed))
            s.swap()
        else:
            in_place(live, hf(seed))
        in_place(reference, hf(seed))
        assert same(state(live), state(reference)), (seed, staged)


def test_a_failed_load_leaves_the_live_model_and_its_loaders_as_they_were():
    live = built()
    before = state(live)
    loaders = {n: getattr(p, "weight_loader", None) for n, p in live.named_parameters()}
    s = shadow.Shadow(live)
    with pytest.raises(KeyError):
        s.load(hf(1)[:2] + [("no.such.weight", torch.zeros(1))])
    assert same(state(live), before)
    assert {n: getattr(p, "weight_loader", None) for n, p in live.named_parameters()} == loaders
    in_place(live, hf(5))                      # the live model still reloads as before
    reference = built()
    in_place(reference, hf(5))
    assert same(state(live), state(reference))


def test_fed_weights_load_in_slices_and_a_failure_is_raised_by_the_swap_touching_nothing(monkeypatch):
    """The engine's thread loads what the staging thread fed, a chunk or more per `advance`
    (every call makes progress, even with no time left); the shadow is ready only once it was
    told nothing more comes and everything is loaded. A load that fails makes it ready with
    the error, which the swap raises, the live model untouched."""
    monkeypatch.setattr(shadow, "CHUNK", 4)
    live, reference = built(), built()
    in_place(reference, hf(1))
    before = state(live)
    s = shadow.Shadow(live)
    s.feed(hf(1))
    left = []
    while not s.advance(0.0):
        left.append(len(s._pending))
        if not s._pending:
            s.complete()
        assert len(left) < 50
    assert left == [6, 2, 0]                 # a chunk per call; the call after `complete` finishes
    assert same(state(live), before)
    s.swap()
    assert same(state(live), state(reference))

    broken = shadow.Shadow(live)
    broken.feed(hf(2)[:3] + [("no.such.weight", torch.zeros(1))])
    broken.complete()
    assert broken.advance() and isinstance(broken.error, KeyError)
    with pytest.raises(shadow.ShadowError, match="could not be prepared"):
        broken.swap()
    assert same(state(live), state(reference))


def test_a_quantized_model_is_refused_for_the_in_place_path():
    assert not shadow.supported(types.SimpleNamespace(quantization="fp8"))
    assert not shadow.supported(None)          # not a vLLM model: nothing is known of its layers
    assert shadow.supported(types.SimpleNamespace(quantization=None))
    with pytest.raises(shadow.ShadowError, match="quantized"):
        shadow.Shadow(built(), types.SimpleNamespace(quantization="fp8"))


def test_a_staged_push_prepares_before_the_pause_and_the_finish_only_swaps():
    """Through the gloo backend as a vLLM worker runs it: buckets received and loaded into the
    shadow on the staging thread; `staged_ready` (what the sender polls before pausing) turns
    true with the live model still the old version; the finish swaps it in."""
    port, token = free_port(), group.new_token()
    store = group.store("127.0.0.1", port, 2, 10.0, sender=True)
    box = {}
    joiner = threading.Thread(target=lambda: box.update(g=group.join(store, 0, 2, token, 10.0)))
    joiner.start()
    live = built()
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
                                   model_config=types.SimpleNamespace(quantization=None, dtype=torch.float32))
    engine = gloo_backend.GlooWeightTransferEngine(None, config, torch.device("cpu"), live)
    engine.init_transfer_engine(gloo_backend.GlooInitInfo(master_address="127.0.0.1", master_port=port,
                                                          rank_offset=1, world_size=2, token=token,
                                                          timeout_s=10.0, staged=True))
    joiner.join()
    before, buckets = state(live), [hf(1)[:3], hf(1)[3:]]
    engine.start_weight_update()
    for named in buckets:
        engine.update_weights(packing.layout(named).to_dict())
    for named in buckets:
        group.broadcast(box["g"], packing.pack(named)[1])
    ready = False
    for _ in range(500):
        ready = engine.staged_ready()
        if ready:
            break
        threading.Event().wait(0.01)
    assert ready and same(state(live), before)
    engine.finish_weight_update()
    reference = built()
    in_place(reference, hf(1))
    assert same(state(live), state(reference))
    engine.shutdown()
