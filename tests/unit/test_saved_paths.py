"""A saved config.yaml (the run dir's, each checkpoint's) names its files by absolute paths:
read from another working directory (`megarl export`, a resume from elsewhere) it still means
the same model, data and folders."""
import os

from omegaconf import OmegaConf

from megarl.config import load_config, save_config


def test_config_yaml_holds_absolute_paths(tmp_path):
    cfg = load_config("recipes/tiny_cpu.yaml", ["run.dir=runs/x", "eval.datasets=[data/a.jsonl]",
                                                "rollout.engines.urls=[http://h:8000]",
                                                "rollout.engines.mode=remote"])
    save_config(cfg, tmp_path / "config.yaml")
    saved = OmegaConf.load(tmp_path / "config.yaml")
    assert saved.model.path == os.path.abspath("artifacts/tiny_countdown")
    assert saved.run.dir == os.path.abspath("runs/x")
    assert list(saved.eval.datasets) == [os.path.abspath("data/a.jsonl")]
    assert os.path.isabs(saved.data.prompts)
    assert saved.checkpoint.dir == "" and list(saved.rollout.engines.urls) == ["http://h:8000"]
    assert cfg.model.path == "artifacts/tiny_countdown"   # the run's own config is unchanged
    again = load_config(tmp_path / "config.yaml")          # and it loads back
    assert again.model.path == os.path.abspath("artifacts/tiny_countdown")
