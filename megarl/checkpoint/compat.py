"""A resume against the checkpoint it resumes: the settings of the run that wrote it (its
config.yaml) compared with this run's, before anything loads.

A change that breaks the run is refused in one line naming the setting, both values and the
fix (`BREAKING`: the estimator, algo.name, decides whether a critic is saved and loaded; the
model's architecture decides every tensor's shape), unless checkpoint.resume=force. Any other
setting that differs is named (`megarl check`, and the line a resumed run prints), except
those a resume is expected to change (`EXPECTED`: the step count, the layout, where things
go). Light: no torch, no megatron (reads YAML and config.json only).
"""
from __future__ import annotations

import os
import types
from pathlib import Path

from omegaconf import OmegaConf

from megarl.config.errors import ConfigError
from megarl.config.schema.model import ArchConfig
from megarl.config.secrets import redacted_dict
from megarl.models.arch import resolve_arch

#: settings a resume may change without a word: the run's length, its layout (checkpoints
#: reshard) and cluster, where its files and engines are, what it logs
EXPECTED = ("train.steps", "run.dir", "run.name", "checkpoint.", "parallel.", "cluster.", "metrics.",
            "rollout.engines.urls", "rollout.engines.mode", "rollout.engines.api_key", "rollout.engines.count",
            "rollout.engines.tp", "weight_sync.staging_dir", "service.api_key")
#: settings whose value is a path: compared as absolute paths (config.yaml keeps them absolute)
PATHS = ("model.path", "model.megatron_path", "data.prompts", "reward.model_path", "run.dir", "checkpoint.dir")
#: what each breaking change does to a run that resumes across it
BREAKING = {"algo.name": "a checkpoint holds a critic only under an estimator that trains one, and the "
                         "optimizer and schedule continue another objective",
            "model": "every weight and optimizer tensor has another shape or meaning"}
#: with LoRA a checkpoint holds the adapters only, loaded onto model.path's base at resume
#: (checkpoint/manager.py): another base or other adapters would load without a shape error
#: into another model
LORA_BREAKING = ("model.path", "model.megatron_path", "model.lora.rank", "model.lora.alpha",
                 "model.lora.targets", "model.lora.critic")
for _key in LORA_BREAKING:
    BREAKING[_key] = ("a LoRA checkpoint holds the adapters only, trained on the base weights and adapter "
                      "settings it was written with: they load onto model.path's weights at resume")


def flat(tree: dict, prefix: str = "") -> dict:
    """{'a.b.c': value} of a nested dict (lists are values)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _same(key: str, a, b) -> bool:
    if key in PATHS and isinstance(a, str) and isinstance(b, str) and a and b:
        return os.path.abspath(a) == os.path.abspath(b)
    return a == b or str(a).lower() == str(b).lower()   # True / "True" across schema versions


def _arch_of(settings: dict):
    """The model's architecture as a run with these (nested) settings resolves it: its
    model.arch facts, else its model.path's config.json; None when neither can be read."""
    model = settings.get("model") or {}
    try:
        arch = ArchConfig(**(model.get("arch") or {}))
        run = types.SimpleNamespace(model=types.SimpleNamespace(arch=arch, path=model.get("path", "")))
        return resolve_arch(run)[0]
    except (ConfigError, TypeError, ValueError, KeyError):
        return None


def saved_settings(checkpoint: Path) -> dict | None:
    """The nested settings of the run that wrote `checkpoint` (None: it has no config.yaml)."""
    path = Path(checkpoint) / "config.yaml"
    if not path.is_file():
        return None
    return OmegaConf.to_container(OmegaConf.load(path))


def changes(saved: dict, cfg) -> tuple[list[str], list[str]]:
    """(breaking, other): each a list of 'key old -> new' lines, `saved` the checkpoint's
    settings (nested), `cfg` this run's RootConfig."""
    ours = redacted_dict(cfg)
    before, now = flat(saved), flat(ours)
    breaking, other = [], []
    adapters_only = bool(before.get("model.lora.rank") or now.get("model.lora.rank"))   # either run LoRA
    for key in sorted(set(before) | set(now)):
        a, b = before.get(key), now.get(key)
        if key not in before or key not in now or _same(key, a, b) or key.startswith("model.arch."):
            continue
        if key.startswith(EXPECTED):
            continue
        breaks = key == "algo.name" or (adapters_only and key in LORA_BREAKING)
        (breaking if breaks else other).append(f"{key} {a!r} -> {b!r}")
    old_arch, new_arch = _arch_of(saved), _arch_of(ours)
    if old_arch is not None and new_arch is not None and old_arch != new_arch:
        diff = [f"{f} {getattr(old_arch, f)} -> {getattr(new_arch, f)}" for f in old_arch.__dataclass_fields__
                if getattr(old_arch, f) != getattr(new_arch, f)]
        breaking.append(f"model architecture ({', '.join(diff[:4])})")
    return breaking, other


def check_resume(cfg, checkpoint: Path) -> list[str]:
    """The settings changed since `checkpoint` was written ('key old -> new'); raises ConfigError
    (one line) for a change that breaks the run unless checkpoint.resume=force."""
    saved = saved_settings(checkpoint)
    if saved is None:
        return []
    breaking, other = changes(saved, cfg)
    if breaking and cfg.checkpoint.resume != "force":
        key = breaking[0].split(" ")[0]
        raise ConfigError(f"checkpoint.resume: {checkpoint} was written with another {key} ({breaking[0]}): "
                          f"{BREAKING.get(key, BREAKING['model'])}; resume with the checkpoint's settings "
                          f"({checkpoint}/config.yaml), start over with checkpoint.resume=false or another "
                          f"checkpoint.dir, or load it anyway with checkpoint.resume=force")
    return breaking + other
