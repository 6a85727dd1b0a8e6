"""LoRA adapters on megatron-core's tensor-parallel linear layers (issue 46, docs/lora.md): the
layer, `apply_lora` (the trainer's actor, models/setup.py), the reference as the adapters turned
off, and the merge the weight push sends (base + scale * B A, per TP shard).

    y = base(x) + (alpha / r) * B(A(dropout(x)))

Split over TP as Megatron-Bridge's PEFT LoRA splits it, so each adapter shard sits where its
base weight's shard sits:
- column-parallel base (linear_qkv, linear_fc1; weight [out/tp, in]): A [r, in] replicated on
  every TP rank, B [out/tp, r] split along the output like the base weight;
- row-parallel base (linear_proj, linear_fc2; weight [out, in/tp]): A [r, in/tp] split along the
  input like the base weight, B [out, r] replicated.
Init: A kaiming-uniform (PEFT's bound 1/sqrt(in)) drawn full-size from a seed of its own per
layer and sliced, so every TP rank's replicated copy is identical and a shard is the same
whatever the TP size; B zeros, so an adapted model starts equal to its base.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Iterator

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)

from megarl.distributed import parallel

#: settings' target name -> megatron's module name, and the parallel kind that module must be
TARGETS = {"qkv": ("linear_qkv", ColumnParallelLinear), "proj": ("linear_proj", RowParallelLinear),
           "fc1": ("linear_fc1", ColumnParallelLinear), "fc2": ("linear_fc2", RowParallelLinear)}


# ---- pure maths ---------------------------------------------------------------------------

def adapter_seed(seed: int, name: str) -> int:
    """The init seed of one layer's adapters: a pure function of the setting's seed and the
    layer's global name (layer numbers counted over every PP stage), so a layer draws the same A
    at any TP x PP layout and two layers never share one."""
    return zlib.crc32(f"{seed}:{name}".encode()) & 0x7FFFFFFF


def kaiming_uniform(rows: int, fan_in: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """[rows, fan_in] uniform in +-1/sqrt(fan_in): torch's kaiming_uniform_(a=sqrt(5)), PEFT's
    and Megatron-Bridge's init of lora_A, drawn on the CPU from `seed` alone."""
    bound = 1.0 / math.sqrt(fan_in)
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(rows, fan_in, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).to(dtype)


def shard(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous part of `full` along `dim` out of `size` equal parts."""
    n = full.shape[dim]
    if n % size:
        raise ValueError(f"dimension {dim} of {tuple(full.shape)} does not split into {size} TP shards")
    return full.narrow(dim, rank * (n // size), n // size).clone()


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B A for one TP shard, in W's dtype (computed in fp32 at least).

    column-parallel: weight [out/tp, in], lora_b [out/tp, r] (this rank's shard), lora_a [r, in];
    row-parallel: weight [out, in/tp], lora_b [out, r], lora_a [r, in/tp] (this rank's shard).
    Either way the shard's B A is exactly the full B A's block at the weight shard's place, so
    each rank merges its own shard with no gather, and the merged shards are the full merged
    weight split as megatron splits the base."""
    wide = torch.promote_types(weight.dtype, torch.float32)
    delta = lora_b.detach().to(wide) @ lora_a.detach().to(wide)
    return (weight.detach().to(wide) + scale * delta).to(weight.dtype)


# ---- the layer ----------------------------------------------------------------------------

class LoRALinear(torch.nn.Module):
    """A frozen megatron Column/RowParallelLinear and its trainable adapters.

    The base's weight and bias are registered on this module under their own names, so the
    model's parameter and state-dict names (the mapping table's, the weight push's, the
    checkpoint's) stay `...linear_qkv.weight`; the adapters add `...linear_qkv.lora_a` and
    `lora_b`. The base module itself is held outside the module tree (it owns nothing else).
    """

    def __init__(self, base: torch.nn.Module, rank: int, alpha: float, dropout: float, seed: int,
                 gated: bool = False):
        """gated: the base is a gated MLP's linear_fc1, whose TP rank r holds [gate_r; up_r] (gate
        and up split separately), so B's rows follow that order too (`set_full`, checkpoints)."""
        super().__init__()
        if not isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
            raise TypeError(f"LoRA wraps megatron's ColumnParallelLinear / RowParallelLinear, not "
                            f"{type(base).__name__} (Transformer Engine layers are not supported yet)")
        object.__setattr__(self, "base", base)     # not a submodule: its params are registered below
        self.column = isinstance(base, ColumnParallelLinear)
        for name in ("weight", "bias"):
            p = getattr(base, name, None)
            if isinstance(p, torch.nn.Parameter):
                p.requires_grad = False
                self._parameters[name] = p   # (register_parameter would see it through __getattr__)
        self.rank, self.scale, self.enabled, self.gated = rank, alpha / rank, True, gated
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        tp, tp_rank = parallel.tp_size(), parallel.tp_rank()
        full_in, full_out = base.input_size, base.output_size
        dtype = base.weight.dtype
        a_full = kaiming_uniform(rank, full_in, seed, dtype)
        if self.column:     # A replicated, B split along the output (dim 0) like the base weight
            a, b = a_full, torch.zeros(full_out // tp, rank, dtype=dtype)
            split, dim = "lora_b", 0
        else:               # A split along the input (dim 1) like the base weight, B replicated
            a, b = shard(a_full, 1, tp_rank, tp), torch.zeros(full_out, rank, dtype=dtype)
            split, dim = "lora_a", 1
        device = base.weight.device
        self.lora_a = torch.nn.Parameter(a.to(device))
        self.lora_b = torch.nn.Parameter(b.to(device))
        # what megatron's DDP, distributed optimizer, grad-norm and checkpoint code read: a split
        # parameter counts once per TP rank, a replicated one only on TP rank 0
        for name in ("lora_a", "lora_b"):
            set_tensor_model_parallel_attributes(getattr(self, name), name == split, dim if name == split else -1, 1)

    def __getattr__(self, name):
        """Whatever the caller reads off the layer it replaced (config, sizes, flags)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "base"), name)

    def get_extra_state(self):
        """The base's (megatron's layers keep an `_extra_state` key for TE's state dicts)."""
        return self.base.get_extra_state()

    def set_extra_state(self, state):
        self.base.set_extra_state(state)

    def set_full(self, a_full: torch.Tensor, b_full: torch.Tensor) -> None:
        """Set the adapters from full-size A [r, in] and B [out, r]: this TP rank keeps its shard.
        A gated fc1's B is [gate; up] (the HF order, the same at any TP): rank r keeps
        [gate_r; up_r], as megatron splits the weight."""
        tp, rank = parallel.tp_size(), parallel.tp_rank()
        if self.gated:
            b_mine = torch.cat([shard(half, 0, rank, tp) for half in b_full.chunk(2, 0)])
        else:
            b_mine = shard(b_full, 0, rank, tp) if self.column else b_full
        with torch.no_grad():
            self.lora_a.copy_(a_full if self.column else shard(a_full, 1, rank, tp))
            self.lora_b.copy_(b_mine)

    def merged(self) -> torch.Tensor:
        """This rank's shard of the merged weight W + (alpha / r) B A (`merged_weight`)."""
        return merged_weight(self.weight, self.lora_a, self.lora_b, self.scale)

    def forward(self, x, *args, **kwargs):
        out, bias = self.base(x, *args, **kwargs)
        if not self.enabled:
            return out, bias
        delta = self._column(x, kwargs) if self.column else self._row(x)
        # megatron returns (output, bias): with skip_bias_add the bias goes back to the caller, to
        # be added in its fused bias-dropout-add; LoRA's term belongs to the output alone either way
        return out + delta.to(out.dtype), bias

    def _column(self, x, kwargs):
        """B_i(A x): x is the whole input (gathered first under sequence parallelism). A's output
        goes through copy_to (identity forward, all-reduce backward): each rank's B shard gives only
        its part of dL/dh, and the sum makes A's gradient (replicated) and the input's gradient whole
        and equal on every rank; the base layer all-reduces its own input gradient separately."""
        b = self.base
        if b.sequence_parallel:
            # the full sequence forward; backward keeps this rank's slice of a gradient that the
            # copy_to below already made whole (a reduce-scatter would sum tp equal copies)
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=b.tp_group)
        h = torch.nn.functional.linear(self.dropout(x), self.lora_a)
        h = copy_to_tensor_model_parallel_region(h, group=b.tp_group)
        y = torch.nn.functional.linear(h, self.lora_b) * self.scale
        gather = kwargs.get("runtime_gather_output")
        if gather if gather is not None else b.gather_output:
            y = gather_from_tensor_model_parallel_region(y, group=b.tp_group)
        return y

    def _row(self, x):
        """B(sum_i A_i x_i). The [.., r] partial sums are all-reduced before B rather than adding
        B(A_i x_i) into the layer's partial output before its own reduce: megatron's layer reduces
        inside forward and returns (output, bias) after it, with no hook between, and B's gradient
        (replicated) would then be each rank's partial one; reducing h costs r numbers per token,
        not out, and leaves B's gradient whole and equal on every rank."""
        b = self.base
        if not b.input_is_parallel:
            raise ValueError("LoRA on a RowParallelLinear expects input_is_parallel=True (as GPTModel's layers)")
        h = torch.nn.functional.linear(self.dropout(x), self.lora_a)
        h = reduce_from_tensor_model_parallel_region(h, group=b.tp_group)
        y = torch.nn.functional.linear(h, self.lora_b) * self.scale
        if b.sequence_parallel:   # the base reduce-scatters its output over the sequence: take our slice
            y = scatter_to_sequence_parallel_region(y, group=b.tp_group)
        return y

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base's own sharded tensors under its usual keys, and the adapters split as above
        (a checkpoint keeps only the adapters: checkpoint/manager.py). A gated fc1's B is saved
        as megatron's MLP saves the weight (its swiglu factory: gate and up as two tensors, each
        split over TP), so it reshards to another TP size; a plain split would mix gate and up rows."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
        out = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        own = {"lora_a": self.lora_a, "lora_b": self.lora_b}
        split = {"lora_b": 0} if self.column else {"lora_a": 1}
        adapters = make_sharded_tensors_for_checkpoint(own, prefix, split, sharded_offsets)
        if self.gated:
            singleton = (metadata or {}).get("singleton_local_shards", False)
            key = f"{prefix}lora_b"
            adapters[key] = apply_swiglu_sharded_factory(adapters[key], sharded_offsets, singleton)
        out.update(adapters)
        return out


# ---- a model ------------------------------------------------------------------------------

def lora_layers(model: torch.nn.Module) -> Iterator[LoRALinear]:
    return (m for m in model.modules() if isinstance(m, LoRALinear))


def apply_lora(model: torch.nn.Module, lora_cfg) -> int:
    """Replace the targeted linear layers of a built GPTModel (this PP stage's) by LoRALinear,
    in place, and freeze every other parameter. lora_cfg: model.lora (rank > 0, alpha, dropout,
    targets, seed). Returns the adapter elements this rank holds (its TP shards and replicas)."""
    cfg = lora_cfg
    if cfg.rank <= 0:
        raise ValueError(f"model.lora.rank={cfg.rank}: apply_lora needs rank > 0")
    names = {TARGETS[t][0]: TARGETS[t][1] for t in cfg.targets}
    experts = getattr(getattr(model, "config", None), "num_moe_experts", None)
    if experts and {"linear_fc1", "linear_fc2"} & set(names):
        raise ValueError(f"model.lora.targets={list(cfg.targets)}: expert MLPs are not supported yet "
                         f"(this model has {experts} experts): target qkv and proj only")
    for p in model.parameters():
        p.requires_grad = False
    _inputs_require_grad(model)
    count = 0
    for layer in model.decoder.layers:
        number = layer.layer_number - 1     # global over PP stages: the seed is the same at any layout
        for parent_name, parent in list(layer.named_modules()):
            for child, module in list(parent.named_children()):
                if child not in names:
                    continue
                where = f"layers.{number}.{parent_name}.{child}"
                if not isinstance(module, names[child]):
                    raise ValueError(f"model.lora.targets: {where} is a {type(module).__name__}, not megatron's "
                                     f"{names[child].__name__} (Transformer Engine layers are not supported yet)")
                gated = child == "linear_fc1" and bool(getattr(module.config, "gated_linear_unit", False))
                wrapped = LoRALinear(module, cfg.rank, cfg.alpha, cfg.dropout, adapter_seed(cfg.seed, where), gated)
                setattr(parent, child, wrapped)
                count += wrapped.lora_a.numel() + wrapped.lora_b.numel()
    if not count:
        raise ValueError(f"model.lora.targets={list(cfg.targets)}: no such layer on this stage")
    return count


def _inputs_require_grad(model: torch.nn.Module) -> None:
    """With the embedding frozen, the first stage's hidden states need no gradient, and megatron's
    activation recompute (train.recompute: a reentrant autograd Function whose only tensor inputs
    are those states) would then give its output none either: no gradient would reach the
    adapters inside. The embedding's output is marked as needing one (HF's
    enable_input_require_grads); only this leaf is marked, the frozen weights stay frozen."""
    embedding = getattr(model, "embedding", None)
    if embedding is None:       # a later PP stage: its input comes from the previous stage, with grad
        return

    def hook(_module, _inputs, out):
        if torch.is_grad_enabled() and torch.is_tensor(out) and not out.requires_grad:
            out.requires_grad_(True)
    embedding.register_forward_hook(hook)


def merged_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter, torch.Tensor]]:
    """(name, parameter, tensor) of every parameter of `model` (this rank's shards) as the engines
    and an HF export see it: a LoRA layer's base weight merged with its adapters (`merged_weight`)
    under the base's name, the adapters themselves left out, everything else as it is. Without
    LoRA layers: every parameter, detached."""
    merged = {id(m.weight): m for m in lora_layers(model)}
    adapters = {id(p) for m in merged.values() for p in (m.lora_a, m.lora_b)}
    for name, p in model.named_parameters():
        if id(p) in adapters:
            continue
        layer = merged.get(id(p))
        yield name, p, layer.merged() if layer is not None else p.detach()


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Every LoRA layer of `model` computes its base only inside the block: the reference
    policy is the actor's base weights, with no second model."""
    layers = list(lora_layers(model))
    before = [m.enabled for m in layers]
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m, was in zip(layers, before):
            m.enabled = was
