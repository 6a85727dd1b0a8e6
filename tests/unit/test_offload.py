"""Offloading idle models frees their storage and brings back exactly the same weights."""
import torch

from megarl.models import offload


def test_offload_frees_storage_and_restores_values():
    """After `enable` the parameters own no memory; inside `resident` they hold the original
    values (views and optimizer references stay valid); after it they are freed again."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    expected = model(x).detach()
    params_before = [p for p in model.parameters()]
    offload.enable(model)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    with offload.resident(model):
        assert torch.equal(model(x), expected)
        assert [p for p in model.parameters()] == params_before   # same Parameter objects
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())


def test_tied_weights_are_offloaded_once():
    """Weights shared by two modules (tied embeddings) are copied and restored once."""
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    before = emb.weight.detach().clone()
    off = offload.Offloader(model)
    assert len(off.tensors) == 1
    off.offload()
    off.reload()
    assert torch.equal(model["head"].weight, before)


def test_resident_leaves_unregistered_models_alone():
    """A model never registered for offloading is untouched by `resident`."""
    model = torch.nn.Linear(2, 2)
    with offload.resident(model) as m:
        assert m is model
    assert model.weight.untyped_storage().nbytes() > 0
