"""A recipe's `defaults:` are read relative to the recipe's own folder, wherever the command
runs; a recipe copied out of recipes/ whose defaults: are not beside it is told why, and the
path that works, in one line."""
import pytest
from conftest import ROOT

from megarl.config import ConfigError, load_config


def test_defaults_are_read_from_the_recipes_folder_not_the_cwd(tmp_path, monkeypatch):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "parent.yaml").write_text("train:\n  steps: 7\n")
    (tmp_path / "mine" / "child.yaml").write_text("defaults:\n  - parent.yaml\n")
    monkeypatch.chdir(tmp_path)
    assert load_config("mine/child.yaml").train.steps == 7


def test_a_copied_recipe_names_its_missing_defaults_and_the_fix(tmp_path):
    copy = tmp_path / "my_7b.yaml"
    copy.write_text((ROOT / "recipes/qwen2.5_7b.yaml").read_text())
    with pytest.raises(ConfigError) as err:
        load_config(copy)
    msg = str(err.value)
    assert "\n" not in msg and "defaults: entry 'base.yaml'" in msg and str(tmp_path / "base.yaml") in msg
    assert "relative to the folder of the recipe" in msg and str(ROOT / "recipes" / "base.yaml") in msg
