"""Fill one rank's megatron shard from an HF checkpoint, reading only what that shard holds.

Every trainer rank (actor, reference, critic, reward model) and every rank of the HF ->
megatron converter load through `load_hf_shard`. The shard's own state dict lists the megatron
parameters of this PP stage; for each one the mapping table names its HF tensors, and only
this TP rank's rows / columns of them are read with safetensors' `get_slice` (through
`HFCheckpoint`, the project's one HF reader). So a rank reads about 1/(TP x PP) of the
checkpoint, opens only the files holding its layers, and never holds a full HF tensor of a
TP-split parameter: peak host memory is its shard plus one parameter's slice.

`shard_from_hf` must equal `ArchMapping.to_shards(...)[tp_rank]` on full tensors (pinned by
tests/unit/test_sliced_loading.py): the slices below are that function's splits, read early.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megarl.config import ConfigError
from megarl.distributed import parallel
from megarl.formats import ops
from megarl.formats.dist_reader import DistCheckpointReader
from megarl.formats.hf_reader import ConversionError, HFCheckpoint, check_hf_checkpoint
from megarl.formats.mapping import is_extra_state, mapping_for
from megarl.models.builders import use_te


def _split_range(size: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    if size % tp:
        raise ValueError(f"cannot split {what} of size {size} into tp={tp} equal shards; the size "
                         f"must be a multiple of tp")
    part = size // tp
    return rank * part, (rank + 1) * part


def shard_from_hf(mapping, row, hf: HFCheckpoint, layer: int | None, tp: int, tp_rank: int,
                  padded_vocab: int, expert: int | None = None) -> torch.Tensor:
    """TP rank `tp_rank`'s tensor of one mapping row (of global `layer` and `expert`), read as
    slices of its HF tensors. An expert's MLP is split over TP as a dense MLP is."""
    d = mapping.dims
    names = [h.format(i=layer, e=expert) for h in row.hf]
    if row.kind == "replicated":
        return hf.get(names[0])
    if row.kind in ("column", "row"):
        dim = row.partition_dim
        start, stop = _split_range(hf.meta(names[0]).shape[dim], tp, tp_rank, f"{names[0]} dim {dim}")
        return hf.get_part(names[0], dim, start, stop)
    if row.kind == "vocab":
        # the vocab is zero-padded to padded_vocab, then split on dim 0: read the real rows of
        # this rank's range and pad the rest
        vocab = hf.meta(names[0]).shape[0]
        start, stop = _split_range(padded_vocab, tp, tp_rank, "the padded vocab")
        real = hf.get_part(names[0], 0, start, min(stop, vocab)) if start < vocab else None
        if real is None:
            return torch.zeros((stop - start, *hf.meta(names[0]).shape[1:]),
                               dtype=hf.meta(names[0]).dtype)
        return ops.pad_vocab(real, stop - start)
    if row.kind == "qkv":
        # a rank holds whole GQA groups nkv/tp: query heads of those groups and their k / v
        # heads are contiguous row ranges of q, k and v
        if d.num_kv_heads % tp:
            raise ValueError(f"num_kv_heads={d.num_kv_heads} is not a multiple of tp={tp}: the fused "
                             f"QKV is split over TP by whole GQA groups; pick a tensor-parallel size "
                             f"that divides num_kv_heads")
        nq, nkv, hd = d.num_heads // tp, d.num_kv_heads // tp, d.head_dim
        q = hf.get_part(names[0], 0, tp_rank * nq * hd, (tp_rank + 1) * nq * hd)
        k, v = (hf.get_part(n, 0, tp_rank * nkv * hd, (tp_rank + 1) * nkv * hd) for n in names[1:])
        return ops.qkv_to_megatron(q, k, v, nq, nkv, hd)
    # gate_up: rank r holds cat([gate_r, up_r]); the op applied to this rank's slices (as one
    # shard) keeps ops.fc1_shards_from_gate_up the one definition of the fused layout
    start, stop = _split_range(hf.meta(names[0]).shape[0], tp, tp_rank, f"{names[0]} dim 0")
    gate, up = (hf.get_part(n, 0, start, stop) for n in names)
    return ops.fc1_shards_from_gate_up(gate, up, 1)[0]


def load_hf_shard(model: torch.nn.Module, info, hf: HFCheckpoint, role: str, mapping=None,
                  progress: Callable[[list], Iterable] | None = None) -> None:
    """Copy this rank's part of the HF checkpoint into `model` (this TP x PP position's shard).

    role "critic" (and the reward model, built as a critic) keeps its own value head: its
    `output_layer.*` is not read. mapping: the table (default: for this model's layer spec).
    progress: wraps the list of parameter names (a tqdm bar in the converter).
    """
    mapping = mapping or mapping_for(info.hf_config, te_names=use_te())
    tp, tp_rank = parallel.tp_size(), parallel.tp_rank()
    own = {k: v for k, v in model.state_dict().items() if not is_extra_state(k)}
    if role == "critic":
        own = {k: v for k, v in own.items() if not k.startswith("output_layer.")}

    def position(name):  # the row, global layer and global expert of a megatron name
        row, local, expert = mapping.locate(name)
        return (row, None if local is None else local + info.layer_offset,
                None if expert is None else expert + info.expert_offset)

    def hf_position(name):  # HF file order, so each file is opened about once
        row, layer, expert = position(name)
        f = hf.files.get(row.hf[0].format(i=layer, e=expert))
        return str(f), -1 if layer is None else layer

    order = sorted(own, key=hf_position)
    with torch.no_grad():
        for name in (progress(order) if progress else order):
            row, layer, expert = position(name)
            shard = shard_from_hf(mapping, row, hf, layer, tp, tp_rank, info.padded_vocab, expert)
            target = own[name]
            if tuple(shard.shape) != tuple(target.shape):
                raise ValueError(f"{name}: megatron shape {tuple(target.shape)} != mapped HF shape "
                                 f"{tuple(shard.shape)} (tp={tp}, pp={parallel.pp_size()})")
            target.copy_(shard)
            del shard
    hf.close()


def open_checked(path: str, mapping, ignore: tuple[str, ...] = ()) -> HFCheckpoint:
    """The HF reader of `path` after checking names and shapes from the headers alone (no tensor
    data is read: a tied lm_head is not compared with the embedding, it is never used)."""
    hf = HFCheckpoint(path)
    check_hf_checkpoint(hf, mapping, ignore=ignore, compare_tied=False)
    return hf


# ---------------------------------------------------------------------------------------------
# weights from a converted megatron checkpoint (model.megatron_path)
# ---------------------------------------------------------------------------------------------

def check_megatron_dir(path: str, setting: str = "model.megatron_path") -> None:
    """A megatron torch_dist checkpoint folder (JSON only: runs before anything is built)."""
    convert = (f"write one with `python tools/convert_hf_to_megatron.py --hf <model.path> --out "
               f"{path} --tp <N> --pp <M>` (any layout loads)")
    if not os.path.isdir(path):
        raise ConfigError(f"{setting}={path!r} does not exist: {convert}")
    meta = os.path.join(path, "metadata.json")
    if not os.path.isfile(meta):
        hf_like = os.path.isfile(os.path.join(path, "config.json"))
        hint = " (it looks like an HF folder: set model.path to it and leave model.megatron_path " \
               "empty)" if hf_like else ""
        raise ConfigError(f"{setting}={path!r} is not a megatron dist checkpoint (no metadata.json)"
                          f"{hint}; {convert}")
    try:
        backend = json.loads(open(meta).read()).get("sharded_backend")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{setting}={path!r}: unreadable metadata.json ({e})") from None
    if backend != "torch_dist":
        raise ConfigError(f"{setting}={path!r} uses sharded_backend={backend!r}; megarl loads "
                          f"torch_dist checkpoints: {convert}")


def megatron_divisible_by(path: str, hf_config, tp: int, setting: str = "model.megatron_path") -> int:
    """The `make_vocab_size_divisible_by` that gives this run's models the checkpoint's padded
    vocab at TP=tp (a dist checkpoint's embedding has one global shape; the trainer must build
    the same one to load it at another layout). Checks the checkpoint against the HF config."""
    try:
        reader = DistCheckpointReader(path)
    except ConversionError as e:
        raise ConfigError(f"{setting}: {e}") from None
    key = "embedding.word_embeddings.weight"
    if key not in reader.metadata:
        raise ConfigError(f"{setting}={path!r} holds no {key!r}: not a GPT model checkpoint")
    padded, hidden = reader.shape(key)
    vocab = hf_config.vocab_size
    if hidden != hf_config.hidden_size or padded < vocab:
        raise ConfigError(f"{setting}={path!r} does not match model.path's config: embedding "
                          f"[{padded}, {hidden}], config vocab_size={vocab}, hidden_size="
                          f"{hf_config.hidden_size}")
    if padded % tp:
        raise ConfigError(f"{setting}={path!r}: its padded vocab {padded} is not a multiple of "
                          f"parallel.tp={tp}; convert again with --vocab-divisible-by so that it is")
    return padded // tp


def load_megatron_shard(model: torch.nn.Module, path: str, role: str) -> None:
    """Load this rank's shard from a megatron dist checkpoint (resharded to this layout by
    megatron). The critic keeps its value head (the checkpoint's output layer is not read)."""
    sharded = model.sharded_state_dict()
    if role == "critic":
        sharded = {k: v for k, v in sharded.items() if not k.startswith("output_layer.")}
    try:
        state = dist_checkpointing.load({"model": sharded}, path)["model"]
    except Exception as e:  # noqa: BLE001 - megatron raises several types for a mismatched folder
        raise ConfigError(f"model.megatron_path={path!r} does not load into this model "
                          f"({type(e).__name__}: {str(e)[:500]})") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (role == "critic" and k.startswith("output_layer."))]
    if missing or unexpected:
        raise ConfigError(f"model.megatron_path={path!r}: missing {missing[:5]}, unexpected "
                          f"{unexpected[:5]}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"megarl: {role} weights loaded from megatron checkpoint {path}", file=sys.stderr,
              flush=True)
