"""Config schema + loader: defaults, recipe inheritance, overrides, and the errors promised."""
import pytest
from omegaconf import OmegaConf

from megarl.config import ConfigError, RootConfig, load_config, save_config, validate_world


def test_recipe_inherits_defaults_and_cli_overrides_win():
    """tiny_cpu.yaml takes base.yaml's settings, its own overrides, then key=value from the CLI."""
    cfg = load_config("recipes/tiny_cpu.yaml", ["train.steps=7", "algo.kl_coef=0.05"])
    assert isinstance(cfg, RootConfig)
    assert cfg.train.steps == 7 and cfg.algo.kl_coef == 0.05
    assert cfg.run.name == "tiny_cpu"                   # from tiny_cpu.yaml
    assert cfg.algo.clip_low == RootConfig().algo.clip_low  # untouched default from the schema


def test_unknown_key_names_key_and_suggests_fix():
    """A misspelt key fails with the full key and the closest real one."""
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.stepz'.*train\.steps"):
        load_config("recipes/tiny_cpu.yaml", ["train.stepz=3"])


def test_unknown_key_in_recipe_file_names_the_file(tmp_path):
    """An unknown key inside a recipe names the recipe it came from."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError, match=r"rollout\.temprature.*bad\.yaml.*rollout\.temperature"):
        load_config(bad)


def test_wrong_type_names_key_and_value():
    """A value of the wrong type names the key and the value."""
    with pytest.raises(ConfigError, match=r"train\.steps: Value 'abc'"):
        load_config(None, ["train.steps=abc"])


def test_impossible_values_name_the_setting():
    """Values the schema can rule out alone fail with key, value and the allowed range."""
    with pytest.raises(ConfigError, match=r"algo\.name='dpo': must be one of \['grpo', 'ppo'\]"):
        load_config(None, ["algo.name=dpo"])
    with pytest.raises(ConfigError, match=r"rollout\.n=1.*grpo"):
        load_config(None, ["algo.name=grpo", "rollout.n=1"])
    with pytest.raises(ConfigError, match=r"algo\.dual_clip=0\.5"):
        load_config(None, ["algo.dual_clip=0.5"])


def test_parallel_sizes_must_divide_world():
    """TP x PP that does not divide the launched ranks fails naming both and the world size."""
    cfg = load_config(None, ["parallel.tp=2", "parallel.pp=2"])
    with pytest.raises(ConfigError, match=r"parallel\.tp x parallel\.pp='2x2'.*world size 2"):
        validate_world(cfg, 2)
    assert validate_world(cfg, 8) == 2


def test_micro_batch_must_split_dp_share():
    """A micro-batch size that does not divide each DP rank's share of a mini-batch is refused."""
    cfg = load_config(None, ["train.groups_per_step=4", "rollout.n=4", "train.micro_batch_size=3"])
    with pytest.raises(ConfigError, match=r"train\.micro_batch_size=3"):
        validate_world(cfg, 1)


def test_override_without_equals_and_missing_recipe():
    """Malformed overrides and missing recipes fail with what to write instead."""
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["train.steps"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("recipes/nope.yaml")


def test_saved_config_reloads_identically(tmp_path):
    """The resolved config written to the run dir loads back to the same values."""
    cfg = load_config("recipes/tiny_cpu.yaml", ["train.steps=5"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert OmegaConf.structured(again) == OmegaConf.structured(cfg)


def test_every_recipe_validates():
    """Each shipped recipe loads against the schema."""
    from pathlib import Path
    for recipe in sorted(Path("recipes").glob("*.yaml")):
        load_config(recipe)


def test_sequence_parallel_needs_tensor_parallel():
    """Sequence parallelism without TP is refused naming the setting."""
    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel=True: needs parallel\.tp > 1"):
        load_config(None, ["parallel.sequence_parallel=true"])


def test_rollout_async_spelling_and_the_settings_it_needs(tmp_path):
    """`rollout.async` (DESIGN's spelling, a Python keyword) is accepted in recipes and on the
    command line; it needs partial mode and a staleness bound of at least one version."""
    assert load_config("recipes/tiny_cpu.yaml", ["rollout.async=true"]).rollout.asynchronous
    recipe = tmp_path / "r.yaml"
    recipe.write_text("defaults: [" + str(__import__("pathlib").Path("recipes/tiny_cpu.yaml").resolve())
                      + "]\nrollout:\n  async: true\n")
    assert load_config(str(recipe)).rollout.asynchronous
    with pytest.raises(ConfigError, match=r"rollout\.async.*rollout\.mode=partial"):
        load_config("recipes/tiny_cpu.yaml", ["rollout.async=true", "rollout.mode=sync"])
    with pytest.raises(ConfigError, match=r"rollout\.max_staleness=0.*>= 1"):
        load_config("recipes/tiny_cpu.yaml", ["rollout.async=true", "rollout.max_staleness=0"])


@pytest.mark.parametrize("override, key", [
    ("rollout.top_p=0.9", "rollout.top_p"),
    ("rollout.engine_mode=cloud", "rollout.engine_mode"),
    ("rollout.engine_mode=remote", "rollout.engine_urls"),
    ("rollout.engine_urls=[node1:8000]", "rollout.engine_urls"),
    ("rollout.mode=fast", "rollout.mode"),
    ("rollout.concurrency=0", "rollout.concurrency"),
    ("rollout.stale_policy=keep", "rollout.stale_policy"),
    ("rollout.engine_timeout_s=0", "rollout.engine_timeout_s"),
    ("rollout.dump_every=-1", "rollout.dump_every"),
])
def test_bad_rollout_settings_name_the_setting(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("recipes/tiny_cpu.yaml", [override])
