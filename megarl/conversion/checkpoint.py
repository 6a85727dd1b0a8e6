"""HF <-> megatron dist checkpoint conversion: the logic behind `tools/convert_hf_to_megatron.py`,
`tools/convert_megatron_to_hf.py` and `tools/compare_logits.py`.

Layout of a converted megatron folder (OUT):
  metadata.json, common.pt, .metadata, __*.distcp   the torch_dist checkpoint of
                                   `{"model": GPTModel.sharded_state_dict()}`, the same "model"
                                   key layout as the trainer's `step_<N>/actor/` folders
  hf_config/                       config.json, generation_config.json and the tokenizer files
                                   (every tokenizer* / *.py file: auto_map may name local code)
  megarl_conversion.json           tp, pp, source, architecture, dtype, padded vocab

Streaming:
  HF -> megatron: one gloo rank per (tp, pp) position builds ITS GPTModel shard (uninitialised
    storage) and fills it one parameter at a time, reading only the HF tensors that parameter
    needs with `safetensors.safe_open` (the index json says which file holds which tensor).
    Peak memory per rank: its megatron shard (which must exist to be saved) + one parameter's
    HF tensors and their TP split (+ megatron's save clones tensors that are views: the gate
    and up halves of every SwiGLU fc1; see bench/RESULTS.md).
  megatron -> HF: no model is built. The checkpoint's tensor metadata gives every global shape;
    one layer at a time is read (a dist checkpoint loads any slice of a global tensor), each
    parameter is mapped with `ArchMapping.megatron_to_hf` and its HF tensors are written
    straight into the current safetensors shard (the shard layout is planned up front by
    running the mapping on meta tensors). Peak: one layer, or ~2.5x the largest tensor.

The conversion always runs on the CPU (gloo, megatron's local layer spec, the CPU shim). The
checkpoint keys are the ones the trainer's own checkpoints have; megatron maps the local spec's
norm names onto Transformer Engine's fused ones (`linear_qkv.layer_norm_weight`), so a TE model
should load them too (not tested here: no GPU).

Errors a user can fix (missing folder, unknown / missing parameters, shape mismatches, bad
TP / PP) raise `ConversionError` (or the mapping's `ValueError`); the CLIs print them in one
line and exit 2.
"""
from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import math
import os
import re
import shutil
import struct
import sys
import time
from pathlib import Path
from typing import Iterable

import torch

from megarl.config.schema import ModelConfig
from megarl.distributed.env import free_port

CONVERSION_JSON = "megarl_conversion.json"
HF_CONFIG_DIR = "hf_config"
INDEX_JSON = "model.safetensors.index.json"
# Files of an HF folder that describe the model and tokenizer (everything but the weights).
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                 "added_tokens.json", "vocab*", "merges.txt", "*.model", "*.tiktoken",
                 "chat_template*", "*.py")
DEFAULT_DIVISIBLE_BY = ModelConfig().make_vocab_size_divisible_by  # the schema owns the default
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class ConversionError(Exception):
    """A problem with the user's input; the CLIs print it without a traceback and exit 2."""


# ---------------------------------------------------------------------------------------------
# HF side: lazy reading, side files, config
# ---------------------------------------------------------------------------------------------

class HFCheckpoint:
    """An HF folder's safetensors, read lazily one tensor at a time.

    Which file holds which tensor comes from `model.safetensors.index.json` when present, else
    from each file's header (safetensors headers are read without touching the data). One
    file is kept open at a time (reading by file order keeps reopening rare).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConversionError(f"HF checkpoint folder {str(path)!r} does not exist")
        if not (self.path / "config.json").is_file():
            raise ConversionError(f"{str(path)!r} has no config.json: not an HF model folder")
        from safetensors import safe_open
        self._safe_open = safe_open
        index = self.path / INDEX_JSON
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.path / f for name, f in weight_map.items()}
            absent = sorted({str(f) for f in self.files.values() if not f.is_file()})
            if absent:
                raise ConversionError(f"{INDEX_JSON} in {str(path)!r} names missing files: {absent[:4]}")
        else:
            found = sorted(self.path.glob("*.safetensors"))
            if not found:
                raise ConversionError(f"{str(path)!r} holds no *.safetensors files (.bin checkpoints "
                                      f"are not supported: re-save with safe_serialization=True)")
            self.files = {}
            for f in found:
                with safe_open(str(f), framework="pt") as sf:
                    for name in sf.keys():
                        self.files[name] = f
        self._open_file: Path | None = None
        self._handle = None

    def names(self) -> list[str]:
        return list(self.files)

    def _file(self, name: str):
        f = self.files.get(name)
        if f is None:
            raise ConversionError(f"HF checkpoint {str(self.path)!r} has no tensor {name!r}")
        if f != self._open_file:
            self.close()
            self._handle = self._safe_open(str(f), framework="pt")
            self._handle.__enter__()
            self._open_file = f
        return self._handle

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor with the stored shape and dtype (no data is read)."""
        sl = self._file(name).get_slice(name)
        dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                 "F64": torch.float64}.get(sl.get_dtype(), torch.float32)
        return torch.empty(sl.get_shape(), dtype=dtype, device="meta")

    def get(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)

    def close(self):
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
        self._handle, self._open_file = None, None


def load_hf_config(path: str | os.PathLike):
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad config
        raise ConversionError(f"cannot read the HF config in {str(path)!r}: {e}") from None


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy config, generation config and every tokenizer file (incl. local *.py code that
    tokenizer_config.json's auto_map may name) from src to dst; returns the names copied."""
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and any(fnmatch.fnmatch(f.name, p) for p in HF_SIDE_FILES) \
                and f.name != INDEX_JSON:
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


def _model_dtype(hf: HFCheckpoint, hf_config, requested: str) -> torch.dtype:
    if requested != "auto":
        return _DTYPES[requested]
    dtype = hf.meta("model.embed_tokens.weight").dtype if "model.embed_tokens.weight" in hf.files \
        else torch.float32
    if dtype not in (torch.float32, torch.bfloat16):
        raise ConversionError(f"HF weights are {dtype}; megarl models are float32 or bfloat16: "
                              f"pass --dtype float32 or --dtype bfloat16")
    return dtype


def check_hf_checkpoint(hf: HFCheckpoint, mapping) -> None:
    """Every HF tensor known, none missing, every shape right; only headers are read (plus
    embedding and lm_head when the config ties them, to check that they are equal)."""
    metas = {n: hf.meta(n) for n in hf.names()}
    if mapping.dims.tied and "lm_head.weight" in metas:
        if "model.embed_tokens.weight" in metas and not torch.equal(
                hf.get("lm_head.weight"), hf.get("model.embed_tokens.weight")):
            raise ConversionError("tie_word_embeddings=True but 'lm_head.weight' differs from "
                                  "'model.embed_tokens.weight'; fix the config or the weights")
        del metas["lm_head.weight"]
    mapping.check_hf(metas, mapping.dims.num_layers)  # raises ValueError naming the problem


# ---------------------------------------------------------------------------------------------
# HF -> megatron
# ---------------------------------------------------------------------------------------------

def _init_world(rank: int, world: int, port: int, threads: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    from megarl.distributed import cpu
    from megarl.distributed.env import init_distributed
    init_distributed(backend="gloo")
    cpu.apply_if_cpu()


def _hf_to_megatron_rank(rank: int, world: int, port: int, threads: int, hf_dir: str, out: str,
                         tp: int, pp: int, dtype_name: str, divisible_by: int,
                         progress: bool) -> None:
    """One gloo rank: build this (tp, pp) position's GPTModel, fill it from the HF files, save."""
    _init_world(rank, world, port, threads)
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from tqdm import tqdm

    from megarl.conversion.mapping import is_extra_state, mapping_for
    from megarl.distributed import parallel
    from megarl.models.builders import build_model
    from megarl.models.config import transformer_config

    parallel.initialize(tp, pp, seed=0)
    hf_config = load_hf_config(hf_dir)
    cfg = transformer_config(hf_config, tp, pp, _DTYPES[dtype_name], on_gpu=False)
    cfg.perform_initialization = False  # every parameter is overwritten below
    model, info = build_model(hf_config, cfg, divisible_by, "actor")
    mapping = mapping_for(hf_config, te_names=False)
    hf = HFCheckpoint(hf_dir)
    tp_rank = parallel.tp_rank()
    own = {k: v for k, v in model.state_dict().items() if not is_extra_state(k)}
    # HF file order, so each file is opened about once
    order = sorted(own, key=lambda n: _first_hf_file(mapping, hf, n, info.layer_offset))
    bar = tqdm(order, desc=f"HF -> megatron (rank {rank}/{world})", unit="tensor",
               disable=not progress or rank != 0, file=sys.stderr)
    with torch.no_grad():
        for name in bar:
            row, local = mapping.find(name)
            layer = None if local is None else local + info.layer_offset
            tensors = [hf.get(h.format(i=layer)) for h in row.hf]
            shard = mapping.to_shards(row, tensors, tp, info.padded_vocab)[tp_rank]
            target = own[name]
            if tuple(shard.shape) != tuple(target.shape):
                raise ConversionError(f"{name}: megatron shape {tuple(target.shape)} != mapped HF "
                                      f"shape {tuple(shard.shape)} (tp={tp}, pp={pp})")
            target.copy_(shard)
            del tensors, shard
    hf.close()
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict()}, out)
    dist.barrier()
    parallel.destroy()
    dist.destroy_process_group()


def _first_hf_file(mapping, hf: HFCheckpoint, name: str, layer_offset: int) -> tuple:
    row, local = mapping.find(name)
    layer = None if local is None else local + layer_offset
    f = hf.files.get(row.hf[0].format(i=layer))
    return (str(f), -1 if layer is None else layer)


def _rank_main(rank: int, world: int, port: int, threads: int, *args) -> None:
    """Entry of a forked rank: user errors exit 2 with one line, not a traceback per rank."""
    try:
        _hf_to_megatron_rank(rank, world, port, threads, *args)
    except (ConversionError, ValueError) as e:
        print(f"convert_hf_to_megatron: error (rank {rank}): {e}", file=sys.stderr, flush=True)
        os._exit(2)


def hf_to_megatron(hf_dir: str, out: str, tp: int = 1, pp: int = 1, dtype: str = "auto",
                   divisible_by: int = DEFAULT_DIVISIBLE_BY, force: bool = False,
                   progress: bool = True) -> dict:
    """Convert an HF folder into a megatron dist checkpoint at TP x PP (launches tp*pp ranks).

    Returns the megarl_conversion.json record.
    """
    if tp < 1 or pp < 1:
        raise ConversionError(f"--tp and --pp must be >= 1, got tp={tp}, pp={pp}")
    hf = HFCheckpoint(hf_dir)
    hf_config = load_hf_config(hf_dir)
    from megarl.conversion.mapping import mapping_for, padded_vocab_size
    from megarl.models.config import transformer_config
    mapping = mapping_for(hf_config)
    model_dtype = _model_dtype(hf, hf_config, dtype)
    transformer_config(hf_config, tp, pp, model_dtype, on_gpu=False)  # TP/PP vs heads/layers
    check_hf_checkpoint(hf, mapping)
    hf.close()

    out_path = Path(out)
    if out_path.exists() and any(out_path.iterdir()):
        if not force:
            raise ConversionError(f"output folder {out!r} is not empty (pass --force to replace it)")
        shutil.rmtree(out_path)
    out_path.mkdir(parents=True, exist_ok=True)

    world = tp * pp
    threads = max(1, (os.cpu_count() or 1) // world)
    args = (str(hf_dir), str(out_path), tp, pp, str(model_dtype).removeprefix("torch."),
            divisible_by, progress)
    t0 = time.perf_counter()
    _launch(world, threads, args)
    record = {
        "format": "megatron-core torch_dist", "key": "model",
        "tp": tp, "pp": pp, "source": str(Path(hf_dir).resolve()),
        "architecture": mapping.arch, "dtype": str(model_dtype).removeprefix("torch."),
        "vocab_size": mapping.dims.vocab, "make_vocab_size_divisible_by": divisible_by,
        "padded_vocab_size": padded_vocab_size(mapping.dims.vocab, divisible_by, tp),
        "num_layers": mapping.dims.num_layers, "tied_embeddings": mapping.dims.tied,
        "megatron_core": _mcore_version(),
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    record["hf_files"] = copy_side_files(Path(hf_dir), out_path / HF_CONFIG_DIR)
    (out_path / CONVERSION_JSON).write_text(json.dumps(record, indent=2) + "\n")
    return record


def _launch(world: int, threads: int, args: tuple) -> None:
    """tp*pp ranks (1 included) as child processes; a rank that fails ends the others.

    Forked, so torch and megatron are not imported again (seconds each on a small machine),
    unless this process has touched CUDA (then spawned). This process itself never creates a
    process group: a child forked from a process holding gloo groups can hang in their
    destructors (threads do not survive a fork), so every conversion gets fresh ranks.
    """
    import torch.multiprocessing as mp
    port = free_port()
    method = "spawn" if torch.cuda.is_initialized() else "fork"
    try:
        mp.start_processes(_rank_main, args=(world, port, threads, *args), nprocs=world,
                           join=True, start_method=method)
    except mp.ProcessExitedException as e:
        what = "stopped on the error above" if e.exit_code == 2 else f"died (exit code {e.exit_code})"
        raise ConversionError(f"conversion rank {e.error_index} {what}; nothing usable was "
                              f"written") from None
    except mp.ProcessRaisedException as e:  # spawn: the traceback comes back as text
        raise ConversionError(f"a conversion rank failed:\n{e}") from None


def _mcore_version() -> str:
    try:
        from importlib.metadata import version
        return version("megatron-core")
    except Exception:  # noqa: BLE001
        return "unknown"


# ---------------------------------------------------------------------------------------------
# megatron -> HF
# ---------------------------------------------------------------------------------------------

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.float64: "F64"}


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
            nbytes = math.prod(shape) * torch.finfo(dtype).bits // 8
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


def _ckpt_key(name: str, metadata: dict) -> tuple[str, int | None]:
    """The checkpoint key of a (TE-named, PP=1) megatron parameter and its index on the
    prepended layer axis (megatron stacks homogeneous layers as one [num_layers, ...] tensor;
    None when the key has no such axis)."""
    m = _LAYER.match(name)
    if m is None:
        return name, None
    if name in metadata:
        return name, None  # non-homogeneous layout: one key per layer
    return f"decoder.layers.{m.group(2)}", int(m.group(1))


class DistCheckpointReader:
    """Reads regions of a megatron torch_dist checkpoint's global tensors.

    The torch_dist format is a torch.distributed.checkpoint (DCP) folder. megatron's own
    `dist_checkpointing.load` cannot read a slice of a global tensor in a one-rank world (it
    assumes every other grid fragment belongs to some other rank), so regions are read with
    DCP's resharding planner directly: no process group, no model.
    """

    def __init__(self, path: str | os.PathLike):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConversionError(f"megatron checkpoint folder {str(path)!r} does not exist")
        meta_json = self.path / "metadata.json"
        if not meta_json.is_file():
            raise ConversionError(f"{str(path)!r} is not a megatron dist checkpoint (no metadata.json)")
        backend = json.loads(meta_json.read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise ConversionError(f"{str(path)!r} uses sharded_backend={backend!r}; only torch_dist "
                                  f"checkpoints are supported")
        self._reader_cls = FileSystemReader
        self.metadata = {k: v for k, v in
                         FileSystemReader(str(self.path)).read_metadata().state_dict_metadata.items()
                         if isinstance(v, TensorStorageMetadata)}

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.metadata[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.metadata[key].properties.dtype

    def read(self, regions: dict[str, tuple[int, ...] | None]) -> dict[str, torch.Tensor]:
        """{key: offsets} -> {key: tensor}. offsets=(i,) reads entry i of the first axis (the
        result drops that axis); None reads the whole tensor."""
        from torch.distributed.checkpoint import DefaultLoadPlanner, load
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        dests, offsets = {}, {}
        for key, index in regions.items():
            shape = self.shape(key)
            if index is None:
                dests[key], offsets[key] = torch.empty(shape, dtype=self.dtype(key)), (0,) * len(shape)
            else:
                dests[key] = torch.empty((len(index), *shape[len(index):]), dtype=self.dtype(key))
                offsets[key] = (*index, *(0,) * (len(shape) - len(index)))

        class RegionPlanner(DefaultLoadPlanner):
            def create_local_plan(self):
                items = []
                for key, dest in self.state_dict.items():
                    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets[key]), sizes=dest.size())
                    items += create_read_items_for_chunk_list(
                        key, self.metadata.state_dict_metadata[key], [chunk])
                return LoadPlan(items)

            def lookup_tensor(self, index):
                return self.state_dict[index.fqn]

        load(dests, storage_reader=self._reader_cls(str(self.path)),
             planner=RegionPlanner(flatten_state_dict=False, allow_partial_load=True), no_dist=True)
        return {k: (t[0] if regions[k] is not None else t) for k, t in dests.items()}


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

    from megarl.conversion.mapping import is_extra_state, mapping_for

    mapping = mapping_for(hf_config, te_names=True)  # dist checkpoint keys use TE's norm names
    dims = mapping.dims
    metadata = {k: v for k, v in reader.metadata.items()
                if not k.startswith("optimizer.") and not is_extra_state(k)}
    names = mapping.megatron_names(dims.num_layers, True, True, 1)
    keys = {n: _ckpt_key(n, metadata) for n in names}
    used = {k for k, _ in keys.values()}
    missing = sorted(used - metadata.keys())
    unknown = sorted(metadata.keys() - used - ({"output_layer.weight"} if dims.tied else set()))
    if missing or unknown:
        raise ConversionError(f"the checkpoint does not match {mapping.arch} with {dims.num_layers} "
                              f"layers (config {str(side)!r}): missing megatron parameters "
                              f"{missing[:8]}, unknown {unknown[:8]}")
    for n, (key, layer) in keys.items():
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
            key, layer = keys[n]
            shape = reader.shape(key)[0 if layer is None else 1:]
            meta = torch.empty(shape, dtype=reader.dtype(key), device="meta")
            plan += [(h, tuple(t.shape), t.dtype) for h, t in mapping.megatron_to_hf(n, [meta]).items()]
    out_path = Path(out)
    if out_path.exists() and any(out_path.iterdir()):
        if not force:
            raise ConversionError(f"output folder {out!r} is not empty (pass --force to replace it)")
        shutil.rmtree(out_path)
    out_path.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out_path, plan, max(1, int(shard_mb * 2**20)))
    bar = tqdm(total=len(names), desc="megatron -> HF", unit="tensor", disable=not progress,
               file=sys.stderr)
    for g in sorted(groups):
        loaded = reader.read({keys[n][0]: None if keys[n][1] is None else (keys[n][1],)
                              for n in groups[g]})
        for n in groups[g]:
            for hf_name, t in mapping.megatron_to_hf(n, [loaded.pop(keys[n][0])]).items():
                writer.add(hf_name, t)
            bar.update(1)
    bar.close()
    index = writer.close()
    copy_side_files(side, out_path)
    return index


# ---------------------------------------------------------------------------------------------
# Logit comparison
# ---------------------------------------------------------------------------------------------

def load_megatron_actor(megatron_dir: str, hf_config_dir: str | None = None):
    """The actor GPTModel at TP=1, PP=1 (fp32) loaded from a dist checkpoint (resharded on
    load), with its ModelInfo. Call in a process whose world is this one rank."""
    from megatron.core import dist_checkpointing

    from megarl.distributed import parallel
    from megarl.models.builders import build_model
    from megarl.models.config import transformer_config

    mdir = Path(megatron_dir)
    if not (mdir / "metadata.json").is_file():
        raise ConversionError(f"{megatron_dir!r} is not a megatron dist checkpoint (no metadata.json)")
    side = Path(hf_config_dir) if hf_config_dir else mdir / HF_CONFIG_DIR
    hf_config = load_hf_config(side)
    metadata = dist_checkpointing.load_tensors_metadata(str(mdir))
    emb = metadata.get("embedding.word_embeddings.weight")
    if emb is None:
        raise ConversionError(f"{megatron_dir!r} has no embedding.word_embeddings.weight")
    padded, dtype = emb.global_shape[0], emb.dtype
    parallel.initialize(1, 1, seed=0)
    cfg = transformer_config(hf_config, 1, 1, dtype, on_gpu=False)
    cfg.perform_initialization = False
    # divisible_by = the stored padded size reproduces the checkpoint's vocab padding at TP=1
    model, info = build_model(hf_config, cfg, padded, "actor")
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(mdir))
    model.load_state_dict(state["model"], strict=True)
    return model.float().eval(), info


def random_prompts(vocab: int, num: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=g)


def logit_stats(hf_logits: torch.Tensor, mg_logits: torch.Tensor) -> dict:
    """Argmax agreement, max / mean |diff| and mean KL(hf || megatron) over all positions."""
    a, b = hf_logits.double(), mg_logits.double()
    diff = (a - b).abs()
    lp, lq = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {"argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).double().mean()),
            "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "kl_hf_megatron": float(kl.mean()), "positions": int(a[..., 0].numel())}


def compare_logits(hf_dir: str, megatron_dir: str, prompts: int = 4, length: int = 32,
                   seed: int = 0, hf_config_dir: str | None = None) -> dict:
    """transformers' forward of `hf_dir` vs megarl's megatron forward of `megatron_dir`, fp32."""
    if not Path(hf_dir).is_dir():
        raise ConversionError(f"HF checkpoint folder {hf_dir!r} does not exist")
    if not Path(megatron_dir).is_dir():
        raise ConversionError(f"megatron checkpoint folder {megatron_dir!r} does not exist")
    _init_world(0, 1, free_port(), max(1, os.cpu_count() or 1))
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from megarl.ppo.schedule import _causal_mask

    model, info = load_megatron_actor(megatron_dir, hf_config_dir)
    tokens = random_prompts(info.vocab_size, prompts, length, seed)
    positions = torch.arange(length).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        mg = model(tokens, positions, _causal_mask(length, tokens.device))[..., :info.vocab_size]
    del model
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = hf_model(input_ids=tokens).logits
    if hf.shape != mg.shape:
        raise ConversionError(f"logit shapes differ: HF {tuple(hf.shape)}, megatron {tuple(mg.shape)}")
    dist.destroy_process_group()
    return logit_stats(hf, mg)


# ---------------------------------------------------------------------------------------------
# CLIs
# ---------------------------------------------------------------------------------------------

def _return_freed_memory(threshold: int = 1 << 20) -> None:
    """Have glibc give tensor-sized blocks back to the OS when they are freed.

    glibc raises its mmap threshold to the size of the largest block freed so far (up to 32
    MiB), after which tensors come from the heap and freed ones stay resident: a converter
    that handles one parameter at a time would still grow towards the model size. A fixed
    threshold keeps each tensor in its own mapping, unmapped when freed. No-op off glibc.
    """
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD (also disables the dynamic threshold)
    except (OSError, AttributeError):
        pass


def _run_cli(prog: str, fn, argv: Iterable[str] | None) -> int:
    """Run fn(argv); user errors become one line on stderr and exit code 2.

    Conversion is a CPU job (see the module docstring): the GPUs are hidden from this process
    (CUDA reads the variable when it is first touched, which has not happened yet)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    _return_freed_memory()
    import warnings
    for category in (UserWarning, FutureWarning, DeprecationWarning):  # megatron's "Apex is not
        warnings.filterwarnings("ignore", category=category)          # installed" x7 and the like
    try:
        return fn(argv) or 0
    except (ConversionError, ValueError, FileNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def cli_hf_to_megatron(argv=None) -> int:
    p = argparse.ArgumentParser(prog="convert_hf_to_megatron",
                                description="HF safetensors folder -> megatron dist checkpoint")
    p.add_argument("--hf", required=True, help="HF model folder (config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="output folder for the dist checkpoint")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="parameter dtype (auto: the HF embedding's)")
    p.add_argument("--vocab-divisible-by", type=int, default=DEFAULT_DIVISIBLE_BY,
                   help="megatron pads the vocab to a multiple of this x TP (the trainer's "
                        "model.make_vocab_size_divisible_by)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--no-progress", action="store_true")

    def run(argv):
        a = p.parse_args(argv)
        rec = hf_to_megatron(a.hf, a.out, a.tp, a.pp, a.dtype, a.vocab_divisible_by, a.force,
                             not a.no_progress)
        print(f"wrote {a.out}: {rec['architecture']} tp={rec['tp']} pp={rec['pp']} "
              f"dtype={rec['dtype']} padded_vocab={rec['padded_vocab_size']} "
              f"({rec['seconds']} s)")
    return _run_cli("convert_hf_to_megatron", run, argv)


def cli_megatron_to_hf(argv=None) -> int:
    p = argparse.ArgumentParser(prog="convert_megatron_to_hf",
                                description="megatron dist checkpoint -> HF safetensors folder")
    p.add_argument("--megatron", required=True, help="dist checkpoint folder (any TP x PP)")
    p.add_argument("--out", required=True, help="output HF folder")
    p.add_argument("--shard-mb", type=float, default=500,
                   help="safetensors shard size in MiB (a larger tensor gets a shard of its own)")
    p.add_argument("--hf-config", default=None,
                   help="folder with config.json + tokenizer (default: <megatron>/hf_config)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--no-progress", action="store_true")

    def run(argv):
        a = p.parse_args(argv)
        t0 = time.perf_counter()
        index = megatron_to_hf(a.megatron, a.out, a.shard_mb, a.hf_config, a.force, not a.no_progress)
        files = len(set(index["weight_map"].values()))
        print(f"wrote {a.out}: {len(index['weight_map'])} tensors, "
              f"{index['metadata']['total_size'] / 2**20:.1f} MiB in {files} shard(s) "
              f"({time.perf_counter() - t0:.1f} s)")
    return _run_cli("convert_megatron_to_hf", run, argv)


def cli_compare_logits(argv=None) -> int:
    p = argparse.ArgumentParser(prog="compare_logits",
                                description="transformers vs megarl/megatron logits on random prompts")
    p.add_argument("--hf", required=True, help="HF model folder")
    p.add_argument("--megatron", required=True, help="megatron dist checkpoint folder")
    p.add_argument("--prompts", type=int, default=4, help="number of random prompts")
    p.add_argument("--length", type=int, default=32, help="tokens per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-4, help="max abs logit difference allowed")
    p.add_argument("--hf-config", default=None, help="config for the megatron side (default: "
                                                     "<megatron>/hf_config)")
    p.add_argument("--json", default=None, help="also write the numbers to this file")

    def run(argv):
        a = p.parse_args(argv)
        s = compare_logits(a.hf, a.megatron, a.prompts, a.length, a.seed, a.hf_config)
        s["tol"] = a.tol
        s["ok"] = s["max_abs_diff"] <= a.tol
        print(f"prompts={a.prompts} x {a.length} tokens  argmax_agreement={s['argmax_agreement']:.4f}  "
              f"max_abs_diff={s['max_abs_diff']:.3e}  mean_abs_diff={s['mean_abs_diff']:.3e}  "
              f"KL(hf||megatron)={s['kl_hf_megatron']:.3e}")
        if a.json:
            Path(a.json).write_text(json.dumps(s, indent=2) + "\n")
        if not s["ok"]:
            print(f"compare_logits: FAIL: max abs logit difference {s['max_abs_diff']:.3e} exceeds "
                  f"--tol {a.tol:g}: the converted model does not reproduce the HF model",
                  file=sys.stderr)
            return 1
        print(f"compare_logits: OK (max abs diff <= {a.tol:g})")
        return 0
    return _run_cli("compare_logits", run, argv)
