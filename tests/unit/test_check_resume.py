"""`megarl check` against what fails later: a model.path of another architecture than the
recipe's `defaults:` model file, and a resume across a change that breaks the run (another
algo.name, another model), refused in one line unless checkpoint.resume=force; other
settings changed since the checkpoint was written are named."""
import pytest
from conftest import ROOT

from megarl import check as megarl_check
from megarl.checkpoint import compat
from megarl.checkpoint import manager as ckpt
from megarl.config import ConfigError, load_config
from megarl.config.loader import save_config


def _recipe(tmp_path, *lines):
    path = tmp_path / "recipe.yaml"
    path.write_text("\n".join(["defaults:", f"  - {ROOT / 'recipes/tiny_cpu.yaml'}", *lines]) + "\n")
    return path


def test_check_refuses_a_model_path_of_another_architecture(tiny_model, tmp_path):
    recipe = _recipe(tmp_path, f"  - {ROOT / 'recipes/models/qwen2.5_7b.yaml'}")
    cfg = load_config(recipe, [f"run.dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError) as err:
        megarl_check.check(cfg, say=lambda line: None)
    msg = str(err.value)
    assert "\n" not in msg and "model.arch" in msg and "model.path" in msg and "hidden" in msg


def _grpo_checkpoint(tmp_path, monkeypatch, *overrides):
    """A checkpoint folder whose config.yaml is a grpo run's; resume_point finds it."""
    step = tmp_path / "ckpt" / "step_3"
    step.mkdir(parents=True)
    save_config(load_config("recipes/tiny_cpu.yaml", ["algo.name=grpo", *overrides]), step / "config.yaml")
    monkeypatch.setattr(ckpt, "resume_point", lambda root, log=None: step)
    return step


def test_check_refuses_resuming_a_grpo_checkpoint_with_ppo(tiny_model, tmp_path, monkeypatch):
    step = _grpo_checkpoint(tmp_path, monkeypatch)
    cfg = load_config("recipes/tiny_cpu.yaml", [f"run.dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}"])
    with pytest.raises(ConfigError) as err:
        megarl_check.check(cfg, say=lambda line: None)
    msg = str(err.value)
    assert "\n" not in msg and str(step) in msg
    assert "algo.name 'grpo' -> 'ppo'" in msg and "checkpoint.resume=force" in msg and "checkpoint.resume=false" in msg


def test_force_resumes_and_the_line_names_every_change(tiny_model, tmp_path, monkeypatch):
    step = _grpo_checkpoint(tmp_path, monkeypatch, "train.actor_lr=3e-6")
    cfg = load_config("recipes/tiny_cpu.yaml", [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.resume=force",
                                                "train.steps=7"])
    line = megarl_check.resume_line(cfg)
    assert line.startswith(f"resumes from {step}") and "checkpoint.resume=force" in line
    assert "algo.name 'grpo' -> 'ppo'" in line and "train.actor_lr 3e-06 -> " in line
    assert "train.steps" not in line and "checkpoint.dir" not in line   # expected to change


def test_the_same_settings_resume_without_a_word(tmp_path):
    cfg = load_config("recipes/tiny_cpu.yaml", ["train.steps=9", "run.dir=elsewhere"])
    step = tmp_path / "step_1"
    step.mkdir()
    save_config(load_config("recipes/tiny_cpu.yaml"), step / "config.yaml")
    assert compat.check_resume(cfg, step) == []


def test_another_model_architecture_is_breaking(tmp_path):
    step = tmp_path / "step_1"
    step.mkdir()
    save_config(load_config(ROOT / "recipes/qwen2.5_7b.yaml"), step / "config.yaml")
    cfg = load_config(ROOT / "recipes/qwen2.5_32b.yaml")
    with pytest.raises(ConfigError, match=r"model architecture \(hidden 3584 -> 5120"):
        compat.check_resume(cfg, step)


def test_checkpoint_resume_takes_true_false_or_force():
    assert load_config("recipes/tiny_cpu.yaml", ["checkpoint.resume=false"]).checkpoint.resume is False
    assert load_config("recipes/tiny_cpu.yaml").checkpoint.resume is True
    with pytest.raises(ConfigError, match="checkpoint.resume='sometimes': must be true .* or force"):
        load_config("recipes/tiny_cpu.yaml", ["checkpoint.resume=sometimes"])
