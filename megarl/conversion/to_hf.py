"""megatron dist checkpoint (any TP x PP) -> HF safetensors folder, without building a model.

The checkpoint's tensor metadata gives every global shape; one layer at a time is read (a dist
checkpoint loads any slice of a global tensor), each parameter is mapped with
`ArchMapping.megatron_to_hf` and its HF tensors are written straight into the current
safetensors shard (the shard layout is planned up front by running the mapping on meta
tensors). Peak: one layer, or ~2.5x the largest tensor.
"""
from __future__ import annotations

import json
import math
import re
import struct
import sys
from pathlib import Path

import torch

from megarl.conversion.output import copy_side_files, prepare_out
from megarl.formats.dist_reader import HF_CONFIG_DIR, DistCheckpointReader
from megarl.formats.hf_reader import INDEX_JSON, ST_TO_TORCH, ConversionError, load_hf_config
from megarl.formats.mapping import is_extra_state, mapping_for

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# megatron saves an MoE layer's experts as one tensor per weight with the expert axis first
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


_ST_DTYPES = {t: s for s, t in ST_TO_TORCH.items()}   # torch dtype -> safetensors name


class ShardWriter:
    """Streams tensors into HF safetensors shards of about `shard_bytes` + the index json.

    Every tensor's name, shape and dtype and the order they arrive in are known up front
    (`plan`), so a shard's header is written when the shard is opened and each tensor's bytes
    go straight to disk as it arrives: nothing is buffered (safetensors' `save_file` would hold
    the whole shard, and a bytes copy of it, in memory). The index json is written last, by
    `close`: a folder without it is an unfinished conversion.
    """

    def __init__(self, out: Path, plan: list[tuple[str, tuple, torch.dtype]], shard_bytes: int):
        self.out = out
        self.shards: list[list[tuple[str, tuple, torch.dtype, int]]] = []
        size = 0
        for name, shape, dtype in plan:
            if dtype not in _ST_DTYPES:
                raise ConversionError(f"{name}: dtype {dtype} cannot be written as safetensors here")
            nbytes = math.prod(shape) * dtype.itemsize
            if not self.shards or (self.shards[-1] and size + nbytes > shard_bytes):
                self.shards.append([])
                size = 0
            self.shards[-1].append((name, tuple(shape), dtype, nbytes))
            size += nbytes
        self.total = sum(e[3] for shard in self.shards for e in shard)
        self._queue = iter([(k, e) for k, shard in enumerate(self.shards) for e in shard])
        self._file, self._open_shard = None, -1

    def filename(self, k: int) -> str:
        return f"model-{k + 1:05d}-of-{len(self.shards):05d}.safetensors"

    def _open(self, k: int) -> None:
        if self._file is not None:
            self._file.close()
        header, offset = {}, 0
        for name, shape, dtype, nbytes in self.shards[k]:
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self._file = open(self.out / self.filename(k), "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._open_shard = k

    def add(self, name: str, t: torch.Tensor) -> None:
        planned = next(self._queue, None)
        if planned is None or planned[1][:3] != (name, tuple(t.shape), t.dtype):
            raise ConversionError(f"internal error: got tensor {name!r} {tuple(t.shape)} {t.dtype}, "
                                  f"planned {planned and planned[1][:3]}")
        if planned[0] != self._open_shard:
            self._open(planned[0])
        data = t.detach().contiguous()
        self._file.write(data.reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> dict:
        left = next(self._queue, None)
        if left is not None:
            raise ConversionError(f"internal error: planned tensor {left[1][0]!r} was never written")
        if self._file is not None:
            self._file.close()
        weight_map = {name: self.filename(k) for k, shard in enumerate(self.shards)
                      for name, *_ in shard}
        index = {"metadata": {"total_size": self.total},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.out / INDEX_JSON).write_text(json.dumps(index, indent=2) + "\n")
        return index


def _ckpt_key(name: str, metadata: dict) -> tuple[str, int | None, int | None]:
    """The checkpoint key of a (TE-named, PP=1, all experts local) megatron parameter, its index
    on the prepended layer axis (megatron stacks homogeneous layers as one [num_layers, ...]
    tensor; None when the key has no such axis) and its expert's index on the expert axis that
    follows (None for a parameter that is not an expert's)."""
    m = _LAYER.match(name)
    if m is None:
        return name, None, None
    rest, expert = m.group(2), None
    if x := _EXPERT.match(rest):
        rest, expert = f"mlp.experts.experts.{x.group(2)}", int(x.group(1))
    per_layer = f"decoder.layers.{m.group(1)}.{rest}"
    if per_layer in metadata:
        return per_layer, None, expert  # non-homogeneous layout: one key per layer
    return f"decoder.layers.{rest}", int(m.group(1)), expert


def megatron_to_hf(megatron_dir: str, out: str, shard_mb: float = 500, hf_config_dir: str | None = None,
                   force: bool = False, progress: bool = True) -> dict:
    """Convert a megatron dist checkpoint (any TP x PP) into an HF safetensors folder.

    hf_config_dir: where config.json and the tokenizer live (default: `<megatron_dir>/hf_config`,
    written by `hf_to_megatron`; pass the original HF folder for a trainer checkpoint's
    `actor/` folder). Returns the index json.
    """
    reader = DistCheckpointReader(megatron_dir)
    mdir = reader.path
    side = Path(hf_config_dir) if hf_config_dir else mdir / HF_CONFIG_DIR
    if not (side / "config.json").is_file():
        raise ConversionError(f"no HF config at {str(side)!r}: pass --hf-config with the original "
                              f"HF folder (config.json and tokenizer files)")
    hf_config = load_hf_config(side)
    from tqdm import tqdm

    mapping = mapping_for(hf_config, te_names=True)  # dist checkpoint keys use TE's norm names
    dims = mapping.dims
    metadata = {k: v for k, v in reader.metadata.items()
                if not k.startswith("optimizer.") and not is_extra_state(k)}
    names = mapping.megatron_names(dims.num_layers, True, True, 1)
    keys = {n: _ckpt_key(n, metadata) for n in names}
    used = {k for k, _, _ in keys.values()}
    missing = sorted(used - metadata.keys())
    unknown = sorted(metadata.keys() - used - ({"output_layer.weight"} if dims.tied else set()))
    if missing or unknown:
        raise ConversionError(f"the checkpoint does not match {mapping.arch} with {dims.num_layers} "
                              f"layers (config {str(side)!r}): missing megatron parameters "
                              f"{missing[:8]}, unknown {unknown[:8]}")
    for key, layer, _ in keys.values():
        if layer is not None and reader.shape(key)[0] != dims.num_layers:
            raise ConversionError(f"checkpoint tensor {key!r} has {reader.shape(key)[0]} layers, "
                                  f"the config {dims.num_layers}")

    # one read per layer (embedding first, then layers, then final norm / output layer)
    groups: dict[int, list[str]] = {}
    for n in names:
        m = _LAYER.match(n)
        g = int(m.group(1)) if m else (-1 if n.startswith("embedding.") else dims.num_layers)
        groups.setdefault(g, []).append(n)
    # the HF tensors, in the order they will be produced: the mapping run on meta tensors
    # (no data), which also checks every shape before anything is written
    plan = []
    for g in sorted(groups):
        for n in groups[g]:
            key, layer, expert = keys[n]
            shape = reader.shape(key)[(layer is not None) + (expert is not None):]
            meta = torch.empty(shape, dtype=reader.dtype(key), device="meta")
            plan += [(h, tuple(t.shape), t.dtype) for h, t in mapping.megatron_to_hf(n, [meta]).items()]
    out_path = prepare_out(out, force)
    writer = ShardWriter(out_path, plan, max(1, int(shard_mb * 2**20)))
    bar = tqdm(total=len(names), desc="megatron -> HF", unit="tensor", disable=not progress,
               file=sys.stderr)
    for g in sorted(groups):
        # a layer's experts share one key: read once, one expert sliced off at a time
        loaded = reader.read({keys[n][0]: None if keys[n][1] is None else (keys[n][1],)
                              for n in groups[g]})
        for n in groups[g]:
            key, _, expert = keys[n]
            t = loaded[key] if expert is None else loaded[key][expert]
            for hf_name, hf_t in mapping.megatron_to_hf(n, [t]).items():
                writer.add(hf_name, hf_t)
            bar.update(1)
        del loaded
    bar.close()
    index = writer.close()
    copy_side_files(side, out_path)
    return index
