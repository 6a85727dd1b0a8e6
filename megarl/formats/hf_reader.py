"""The one HF checkpoint reader of megarl: an HF folder's safetensors read lazily, one tensor (or
one slice of a tensor) at a time.

Both the checkpoint converter (`megarl.conversion.to_megatron`) and the trainer's model loading
(`megarl.models.loading`) read through `HFCheckpoint`, so a 70B checkpoint is never held whole
by one process: each reader asks only for the tensors (and, with `get_slice`, only the rows or
columns) its megatron shard needs. Errors a user can fix raise `ConversionError`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

INDEX_JSON = "model.safetensors.index.json"
# safetensors dtype names -> torch dtypes (the converter writes them back: to_hf)
ST_TO_TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
               "F64": torch.float64}


class ConversionError(Exception):
    """A problem with the user's input; the CLIs print it without a traceback and exit 2."""


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
                with self._opened(f) as sf:
                    for name in sf.keys():
                        self.files[name] = f
        self._open_file: Path | None = None
        self._handle = None

    def _opened(self, f: Path):
        """safe_open(f), or a ConversionError naming the file (a truncated or damaged copy:
        safetensors' own error names neither the file nor the fix)."""
        from safetensors import SafetensorError
        try:
            return self._safe_open(str(f), framework="pt")
        except (SafetensorError, OSError) as err:
            raise ConversionError(f"{f.name} in {str(self.path)!r} is not a readable safetensors file ({err}): "
                                  f"truncated or damaged; copy it again from the model's source") from None

    def names(self) -> list[str]:
        return list(self.files)

    def _file(self, name: str):
        f = self.files.get(name)
        if f is None:
            raise ConversionError(f"HF checkpoint {str(self.path)!r} has no tensor {name!r}")
        if f != self._open_file:
            self.close()
            self._handle = self._opened(f)
            self._handle.__enter__()
            self._open_file = f
        return self._handle

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor with the stored shape and dtype (no data is read)."""
        sl = self._file(name).get_slice(name)
        dtype = ST_TO_TORCH.get(sl.get_dtype(), torch.float32)
        return torch.empty(sl.get_shape(), dtype=dtype, device="meta")

    def get(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)

    def get_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Entries start..stop-1 of `name` along `dim`, read without materialising the rest of
        the tensor (safetensors maps the file and copies only the slice)."""
        index = (slice(None),) * dim + (slice(start, stop),)
        return self._file(name).get_slice(name)[index]

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


def check_hf_checkpoint(hf: HFCheckpoint, mapping, ignore: tuple[str, ...] = (),
                        compare_tied: bool = True) -> None:
    """Every HF tensor known, none missing, every shape right; only headers are read (plus
    embedding and lm_head when the config ties them and `compare_tied`, to check that they are
    equal). `ignore`: names the mapping does not cover (a reward model's `score.weight`)."""
    metas = {n: hf.meta(n) for n in hf.names() if n not in ignore}
    if mapping.dims.tied and "lm_head.weight" in metas:
        # a tied model's output layer is its embedding: lm_head is never read, only compared
        if compare_tied and "model.embed_tokens.weight" in metas and not torch.equal(
                hf.get("lm_head.weight"), hf.get("model.embed_tokens.weight")):
            raise ConversionError("tie_word_embeddings=True but 'lm_head.weight' differs from "
                                  "'model.embed_tokens.weight'; fix the config or the weights")
        del metas["lm_head.weight"]
    mapping.check_hf(metas, mapping.dims.num_layers)  # raises ValueError naming the problem
