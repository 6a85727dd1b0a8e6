"""`megarl export` of a LoRA run (model.lora.rank > 0): a PEFT adapter folder, and on request the
merged full model.

A LoRA checkpoint's actor holds the adapters only (checkpoint/manager.py, its base.json naming the
base model). The adapters are read whole from it (each layer's A and B, layer-stacked as
megatron saves them: fc1's B in HF [gate; up] order through megatron's SwiGLU factory, QKV's in
megatron's GQA-grouped rows) and converted to PEFT names (formats/lora_peft.py):

- `<out>`: `adapter_config.json` (r, lora_alpha, target_modules, base_model_name_or_path) and
  `adapter_model.safetensors`, which peft (`PeftModel.from_pretrained`) and vLLM (a LoRARequest
  with the folder as its path) load onto the base model;
- with `--merged`, `<out>/merged`: the base model's safetensors with each adapted weight replaced
  by W + (alpha / r) B A (fp32 maths, the base's dtype), its config and tokenizer, loadable as
  any HF model.
Both are written atomically like every export (hf_export.publish).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megarl.checkpoint.manager import BASE_FILE
from megarl.conversion.output import copy_side_files
from megarl.formats import lora_peft
from megarl.formats.dist_reader import DistCheckpointReader
from megarl.formats.hf_reader import INDEX_JSON, ConversionError
from megarl.formats.mapping import mapping_for

MERGED = "merged"
_STACKED = re.compile(r"^decoder\.layers\.(.+)\.lora_([ab])$")


def is_lora_checkpoint(actor_dir: Path) -> bool:
    """Whether a checkpoint's actor folder holds LoRA adapters only (a base.json beside them)."""
    return (Path(actor_dir) / BASE_FILE).is_file()


def peft_tensors(actor_dir: Path, hf_config) -> dict[str, torch.Tensor]:
    """The checkpoint's adapters as PEFT tensors (every layer, global numbers)."""
    reader = DistCheckpointReader(actor_dir)
    keys = sorted(k for k in reader.metadata if _STACKED.match(k))
    if not keys:
        raise ConversionError(f"{actor_dir}: a LoRA checkpoint (base.json) without adapter tensors "
                              f"(*.lora_a / *.lora_b)")
    full = reader.read(dict.fromkeys(keys))
    table = mapping_for(hf_config)
    out: dict[str, torch.Tensor] = {}
    modules = sorted({_STACKED.match(k).group(1) for k in keys})
    for module in modules:
        a, b = full[f"decoder.layers.{module}.lora_a"], full[f"decoder.layers.{module}.lora_b"]
        for i in range(a.shape[0]):      # layer-stacked: dim 0 is the global layer number
            out.update(lora_peft.to_peft(table, f"decoder.layers.{i}.{module}", [a[i]], [b[i]]))
    return out


def lora_settings(checkpoint: Path) -> tuple[int, float]:
    """model.lora.rank and alpha of the checkpoint's config.yaml."""
    from omegaconf import OmegaConf
    cfg = OmegaConf.load(checkpoint / "config.yaml")
    rank, alpha = OmegaConf.select(cfg, "model.lora.rank"), OmegaConf.select(cfg, "model.lora.alpha")
    if not rank:
        raise ConversionError(f"{checkpoint / 'config.yaml'}: model.lora.rank is not set, yet the actor holds adapters")
    return int(rank), float(alpha)


def base_of(actor_dir: Path, side: Path) -> str:
    """The base model's path the adapters were trained on (base.json), else the side folder."""
    try:
        return json.loads((Path(actor_dir) / BASE_FILE).read_text()).get("base") or str(side)
    except (OSError, ValueError):
        return str(side)


def write_merged(tensors: dict[str, torch.Tensor], scale: float, side: Path, out: Path) -> None:
    """The base model of `side` (model.path) with every adapted weight W + scale * B A, one
    safetensors file at a time (the base's files and index, so the folder loads as the base)."""
    merged_any = set()
    files = sorted(side.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{side}: no *.safetensors weights to merge the adapters into")
    out.mkdir(parents=True, exist_ok=True)
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            weights = {name: f.get_tensor(name) for name in f.keys()}
        for name, w in weights.items():
            a_name, b_name = _peft_names(name)
            if a_name in tensors:
                delta = tensors[b_name].double() @ tensors[a_name].double()
                weights[name] = (w.double() + scale * delta).to(w.dtype)
                merged_any.add(name)
        save_file(weights, str(out / path.name), metadata={"format": "pt"})
    missing = sorted({n.removesuffix(".lora_A.weight") for n in tensors if n.endswith(".lora_A.weight")}
                     - {lora_peft.PEFT_PREFIX + n.removesuffix(".weight") for n in merged_any})
    if missing:
        raise ConversionError(f"{side}: the base model has no weight for the adapters of {missing[:4]}")
    copy_side_files(side, out)          # config, generation config, tokenizer files
    index = side / INDEX_JSON
    if index.is_file():                 # the same files hold the same names
        shutil.copy2(index, out / INDEX_JSON)


def _peft_names(hf_weight: str) -> tuple[str, str]:
    base = lora_peft.PEFT_PREFIX + hf_weight.removesuffix(".weight")
    return base + ".lora_A.weight", base + ".lora_B.weight"


def export_peft(checkpoint: Path, side: Path, tmp: Path, merged: bool) -> None:
    """A LoRA checkpoint's actor as a PEFT adapter folder `tmp` (and `tmp/merged` on request)."""
    from transformers import AutoConfig
    actor = checkpoint / "actor"
    hf_config = AutoConfig.from_pretrained(str(side))
    rank, alpha = lora_settings(checkpoint)
    tensors = peft_tensors(actor, hf_config)
    lora_peft.write_adapter(tmp, tensors, rank, alpha, base_of(actor, side))
    if merged:
        write_merged(tensors, alpha / rank, side, tmp / MERGED)
