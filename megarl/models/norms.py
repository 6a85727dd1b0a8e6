"""Sequence parallelism without Transformer Engine: megatron's local (CPU) layer spec builds its
norms with `WrappedTorchNorm`, which asserts `sequence_parallel` off, although a torch RMSNorm
normalises each token on its own and computes the same on a slice of the sequence. What
sequence parallelism adds is the gradient: each TP rank sees only its part of the sequence, so
the norm weights' gradients must be summed over TP, which megatron's finalize_model_grads does
for every parameter tagged `sequence_parallel` (TE's norms and the MoE router tag theirs).

megatron's MoE layers train at TP > 1 only under sequence parallelism (their token dispatcher
expects each TP rank to hold its own slice of the tokens), so an MoE model at TP x EP on CPU
needs these norms.
"""
from __future__ import annotations

import copy
import dataclasses

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, _get_block_submodules


class SequenceParallelTorchNorm:
    """WrappedTorchNorm's torch norm, built also under sequence parallelism, its parameters
    tagged so that their gradients are summed over the TP ranks."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        plain = copy.copy(config)   # a shallow copy: TransformerConfig's checks do not run again
        plain.sequence_parallel = False
        norm = WrappedTorchNorm(plain, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def _replace_norms(node):
    """`node` (a spec, submodules dataclass, list or dict) with every WrappedTorchNorm replaced
    by SequenceParallelTorchNorm; specs are copied, never changed in place (megatron's spec
    functions may return shared module-level objects)."""
    if node is WrappedTorchNorm:
        return SequenceParallelTorchNorm
    if isinstance(node, list):
        return [_replace_norms(x) for x in node]
    if isinstance(node, dict):
        return {k: _replace_norms(v) for k, v in node.items()}
    if isinstance(node, ModuleSpec) or (dataclasses.is_dataclass(node) and not isinstance(node, type)):
        changes = {f.name: _replace_norms(getattr(node, f.name)) for f in dataclasses.fields(node)}
        return dataclasses.replace(node, **changes)
    return node


def sequence_parallel_spec(spec, config, pp_rank: int):
    """A local (non-TE) decoder spec whose norms allow sequence parallelism: a layer spec is
    first expanded into the block of this stage's layers, as megatron does, so that the block's
    final norm is replaced too."""
    if not config.sequence_parallel:
        return spec
    if not isinstance(spec, TransformerBlockSubmodules):
        spec = _get_block_submodules(config, spec, pp_rank=pp_rank)
    return _replace_norms(spec)
