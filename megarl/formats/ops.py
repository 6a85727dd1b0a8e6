"""Pure shard/merge ops between HF and megatron-core tensor layouts.

No torch.distributed, no megatron imports: every function takes and returns plain tensors,
so each one can be checked on CPU with `torch.arange` tensors (every element unique, so any
permutation shows). Notation: H hidden size, F MLP intermediate size, V vocab size,
nq / nkv query / key-value heads, d head dim, tp tensor-parallel size.
"""
from __future__ import annotations

import torch
from torch import Tensor


def split_along(t: Tensor, dim: int, tp: int) -> list[Tensor]:
    """Split `t` into `tp` equal shards along `dim`: [.., S, ..] -> tp x [.., S/tp, ..].

    Shards are independent (cloned) tensors, so saving one does not save the whole storage.
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got tp={tp}")
    size = t.shape[dim]
    if size % tp:
        raise ValueError(
            f"cannot split dim {dim} of size {size} (shape {tuple(t.shape)}) into tp={tp} equal "
            f"shards; the size must be a multiple of tp")
    return [c.clone() for c in torch.chunk(t, tp, dim=dim)]


def cat_along(shards: list[Tensor], dim: int) -> Tensor:
    """Inverse of `split_along`: tp x [.., S/tp, ..] -> [.., S, ..]."""
    if not shards:
        raise ValueError("cat_along got no shards")
    return torch.cat(list(shards), dim=dim)


def pad_vocab(t: Tensor, padded_size: int) -> Tensor:
    """Zero-pad dim 0 (the vocab) from V to `padded_size`: [V, ..] -> [padded_size, ..]."""
    vocab = t.shape[0]
    if padded_size < vocab:
        raise ValueError(f"padded vocab size {padded_size} is smaller than the vocab size {vocab}")
    if padded_size == vocab:
        return t
    return torch.cat([t, t.new_zeros((padded_size - vocab, *t.shape[1:]))], dim=0)


def unpad_vocab(t: Tensor, true_size: int) -> Tensor:
    """Drop megatron's vocab padding rows: [V_pad, ..] -> [true_size, ..]."""
    if t.shape[0] < true_size:
        raise ValueError(
            f"tensor of shape {tuple(t.shape)} has fewer rows than the vocab size {true_size}")
    if t.shape[0] == true_size:
        return t
    return t[:true_size].clone()


def _check_gqa(num_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    return num_heads // num_kv_heads


def qkv_to_megatron(q: Tensor, k: Tensor, v: Tensor, num_heads: int, num_kv_heads: int,
                    head_dim: int) -> Tensor:
    """Fuse HF q/k/v into megatron's `linear_qkv` layout, interleaved per GQA group.

    q: [nq*d, *rest], k, v: [nkv*d, *rest] (rest = (H,) for weights, () for biases)
    -> [nkv*(nq/nkv + 2)*d, *rest], where group g holds its nq/nkv query heads, then k_g, then v_g.
    """
    per_group = _check_gqa(num_heads, num_kv_heads)
    rest = tuple(q.shape[1:])
    expected = {"q": (num_heads * head_dim, *rest), "k": (num_kv_heads * head_dim, *rest),
                "v": (num_kv_heads * head_dim, *rest)}
    for name, t in (("q", q), ("k", k), ("v", v)):
        if tuple(t.shape) != expected[name]:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected {expected[name]} for "
                f"num_heads={num_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}")
    fused = torch.cat([q.reshape(num_kv_heads, per_group * head_dim, *rest),
                       k.reshape(num_kv_heads, head_dim, *rest),
                       v.reshape(num_kv_heads, head_dim, *rest)], dim=1)
    return fused.reshape(num_kv_heads * (per_group + 2) * head_dim, *rest)


def qkv_from_megatron(fused: Tensor, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `qkv_to_megatron`: [nkv*(nq/nkv + 2)*d, *rest] -> q [nq*d, *rest], k, v [nkv*d, *rest]."""
    per_group = _check_gqa(num_heads, num_kv_heads)
    rest = tuple(fused.shape[1:])
    rows = num_kv_heads * (per_group + 2) * head_dim
    if fused.shape[0] != rows:
        raise ValueError(
            f"fused qkv has shape {tuple(fused.shape)}, expected dim 0 = {rows} for "
            f"num_heads={num_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}")
    grouped = fused.reshape(num_kv_heads, (per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(num_heads * head_dim, *rest), k.reshape(num_kv_heads * head_dim, *rest),
            v.reshape(num_kv_heads * head_dim, *rest))


def qkv_shards(fused: Tensor, num_kv_heads: int, tp: int) -> list[Tensor]:
    """Split a fused megatron qkv [nkv*(nq/nkv + 2)*d, *rest] over TP by whole GQA groups.

    Each rank gets nkv/tp complete groups: [nkv/tp*(nq/nkv + 2)*d, *rest]. Merging is
    `cat_along(shards, 0)`.
    """
    if num_kv_heads % tp:
        raise ValueError(
            f"num_kv_heads={num_kv_heads} is not a multiple of tp={tp}: the fused QKV is split "
            f"over TP by whole GQA groups; pick a tensor-parallel size that divides num_kv_heads")
    return split_along(fused, 0, tp)


def fc1_shards_from_gate_up(gate: Tensor, up: Tensor, tp: int) -> list[Tensor]:
    """Per-TP-rank megatron `linear_fc1` shards from HF gate/up: gate, up [F, H] -> tp x [2F/tp, H].

    Rank r holds cat([gate_r, up_r]): gate and up are split *separately* and then fused per
    rank. Chunking the fused full tensor cat([gate, up]) instead is the classic TP>=2 bug
    (rank 0 would get all of gate, rank 1 all of up).
    """
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} shapes differ")
    return [torch.cat([g, u], dim=0)
            for g, u in zip(split_along(gate, 0, tp), split_along(up, 0, tp))]


def gate_up_from_fc1_shards(shards: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Inverse of `fc1_shards_from_gate_up`: tp x [2F/tp, H] -> gate [F, H], up [F, H]."""
    if not shards:
        raise ValueError("gate_up_from_fc1_shards got no shards")
    gates, ups = [], []
    for r, s in enumerate(shards):
        if s.shape[0] % 2:
            raise ValueError(f"fc1 shard of TP rank {r} has odd dim 0: shape {tuple(s.shape)}")
        g, u = torch.chunk(s, 2, dim=0)
        gates.append(g)
        ups.append(u)
    return torch.cat(gates, dim=0), torch.cat(ups, dim=0)
