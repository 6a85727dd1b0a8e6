"""A converted megatron folder: where its parts live, and a reader of its global tensors.

This module sits below everything that reads or writes such a folder: the converters
(`megarl.conversion.to_hf`, `to_megatron`, `compare`) and the trainer's loading
(`megarl.models.loading`, for `model.megatron_path`). It imports nothing of megarl but
`hf_reader`'s error type, so the imports between those run one way
(tests/unit/test_import_cycles.py keeps it so).

Layout of a folder `megarl.conversion.to_megatron` writes (its module docstring has the rest):
  HF_CONFIG_DIR/     config.json, generation config and tokenizer files of the source model
  CONVERSION_JSON    tp, pp, source, architecture, dtype, padded vocab
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megarl.formats.hf_reader import ConversionError

HF_CONFIG_DIR = "hf_config"
CONVERSION_JSON = "megarl_conversion.json"


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
