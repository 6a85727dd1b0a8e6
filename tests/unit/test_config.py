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
    with pytest.raises(ConfigError, match=r"rollout\.temprature.*bad\.yaml.*rollout\.sampling\.temperature"):
        load_config(bad)


def test_wrong_type_names_key_and_value():
    """A value of the wrong type names the key and the value."""
    with pytest.raises(ConfigError, match=r"train\.steps: Value 'abc'"):
        load_config(None, ["train.steps=abc"])


def test_impossible_values_name_the_setting():
    """Values the schema can rule out alone fail with key, value and the allowed range."""
    with pytest.raises(ConfigError, match=r"algo\.name='dpo': unknown algorithm .*use one of grpo, ppo"):
        load_config(None, ["algo.name=dpo"])
    with pytest.raises(ConfigError, match=r"rollout\.sampling\.n=1.*grpo"):
        load_config(None, ["algo.name=grpo", "rollout.sampling.n=1"])
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
    cfg = load_config(None, ["train.groups_per_step=4", "rollout.sampling.n=4", "train.micro_batch_size=3"])
    with pytest.raises(ConfigError, match=r"train\.micro_batch_size=3"):
        validate_world(cfg, 1)


def test_override_without_equals_and_missing_recipe():
    """Malformed overrides and missing recipes fail with what to write instead."""
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["train.steps"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("recipes/nope.yaml")


def test_saved_config_reloads_identically(tmp_path):
    """The resolved config written to the run dir loads back to the same values (its paths
    absolute: config/secrets.PATH_SETTINGS)."""
    from megarl.config.secrets import redacted
    cfg = load_config("recipes/tiny_cpu.yaml", ["train.steps=5"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert OmegaConf.structured(again) == redacted(cfg)


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
    """`rollout.partial.async` (DESIGN's spelling, a Python keyword) is accepted in recipes and on the
    command line; it needs partial mode and a staleness bound of at least one version."""
    assert load_config("recipes/tiny_cpu.yaml", ["rollout.partial.async=true"]).rollout.partial.asynchronous
    recipe = tmp_path / "r.yaml"
    recipe.write_text("defaults: [" + str(__import__("pathlib").Path("recipes/tiny_cpu.yaml").resolve())
                      + "]\nrollout:\n  async: true\n")
    assert load_config(str(recipe)).rollout.partial.asynchronous
    with pytest.raises(ConfigError, match=r"rollout\.partial\.async.*rollout\.mode=partial"):
        load_config("recipes/tiny_cpu.yaml", ["rollout.partial.async=true", "rollout.mode=sync"])
    with pytest.raises(ConfigError, match=r"rollout\.partial\.max_staleness=0.*>= 1"):
        load_config("recipes/tiny_cpu.yaml", ["rollout.partial.async=true", "rollout.partial.max_staleness=0"])


@pytest.mark.parametrize("override, key", [
    ("rollout.sampling.top_p=0", "rollout.sampling.top_p"),
    ("rollout.sampling.top_p=1.5", "rollout.sampling.top_p"),
    ("rollout.sampling.top_k=0", "rollout.sampling.top_k"),
    ("rollout.sampling.top_k=-2", "rollout.sampling.top_k"),
    ("rollout.engines.mode=cloud", "rollout.engines.mode"),
    ("rollout.engines.mode=remote", "rollout.engines.urls"),
    ("rollout.engines.urls=[node1:8000]", "rollout.engines.urls"),
    ("rollout.mode=fast", "rollout.mode"),
    ("rollout.partial.concurrency=0", "rollout.partial.concurrency"),
    ("rollout.partial.stale_policy=keep", "rollout.partial.stale_policy"),
    ("rollout.engines.timeout_s=0", "rollout.engines.timeout_s"),
    ("rollout.dump_every=-1", "rollout.dump_every"),
    ("rollout.engines.gpu_memory_utilization=1.5", "rollout.engines.gpu_memory_utilization"),
    ("rollout.engines.urls=[http://node1:8000/v1]", "rollout.engines.urls"),
    ("rollout.update_mode=pause", "rollout.update_mode"),
    ("rollout.update_mode=[keep]", "rollout.update_mode"),
])
def test_bad_rollout_settings_name_the_setting(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("recipes/tiny_cpu.yaml", [override])


def test_a_recipe_that_is_not_yaml_names_the_file_and_the_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [\n  dir: x\n")
    with pytest.raises(ConfigError, match=r"recipe '.*bad\.yaml' is not valid YAML .*line 3"):
        load_config(bad)
    tabs = tmp_path / "tabs.yaml"
    tabs.write_text("train:\n  steps: 3\n\tfoo: 1\n")
    with pytest.raises(ConfigError, match=r"tabs\.yaml' is not valid YAML \(found a tab"):
        load_config(tabs)


def test_a_recipe_must_be_sections_and_a_section_is_not_a_value(tmp_path):
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"list\.yaml' holds a list, not sections"):
        load_config(listed)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("train: 5\n")
    with pytest.raises(ConfigError, match=r"train is a section of settings .*scalar\.yaml"):
        load_config(scalar)
    with pytest.raises(ConfigError, match=r"model\.arch is a section.*the command line"):
        load_config(None, ["model.arch=3"])
    with pytest.raises(ConfigError, match=r"is a folder"):
        load_config(str(tmp_path))
    # a section whose lines are all commented out changes nothing
    empty = tmp_path / "empty_section.yaml"
    empty.write_text("algo:\n#  kl_coef: 1\ntrain:\n  steps: 4\n")
    assert load_config(empty).train.steps == 4


def test_override_values_that_are_not_yaml_or_not_a_list():
    with pytest.raises(ConfigError, match=r"override 'train\.steps=\[1': its value is not valid YAML"):
        load_config(None, ["train.steps=[1"])
    with pytest.raises(ConfigError, match=r"override '=3' is not key=value"):
        load_config(None, ["=3"])
    with pytest.raises(ConfigError, match=r"rollout\.engines\.urls is a list.*\[a,b\]"):
        load_config(None, ["rollout.engines.mode=remote", "rollout.engines.urls=http://node1:8000"])


@pytest.mark.parametrize("overrides, match", [
    # a setting another one makes unused is refused, not silently ignored
    (["rollout.engines.urls=[http://node1:8000]"], r"rollout\.engines\.urls=.*only with rollout\.engines\.mode=remote"),
    (["rollout.engines.mode=local_servers", "rollout.engines.urls=[http://node1:8000]"], r"'local_servers'"),
    (["rollout.engines.api_key=secret"], r"rollout\.engines\.api_key='<set>': is used only by engine servers"),
    (["algo.name=grpo", "train.critic_warmup_steps=3"],
     r"train\.critic_warmup_steps=3: is not used with algo\.name=grpo"),
    (["reward.model_coef=0.5"], r"reward\.model_coef=0\.5: .*reward\.model_path is empty"),
    # issue 20's settings: each one only where it acts
    (["rollout.update_mode=abort", "rollout.keep_kv=true"],
     r"rollout\.keep_kv=True: applies only to rollout\.update_mode=keep"),
    (["rollout.mode=sync", "rollout.keep_kv=true"], r"rollout\.keep_kv=True: applies only to rollout\.mode=partial"),
    (["rollout.mode=sync", "rollout.overlap=true"], r"rollout\.overlap=True: needs rollout\.mode=partial"),
    # issue 21's stabilizers and lag: out of range, contradictory, or left unused
    (["algo.m2po_tau=0"], r"algo\.m2po_tau=0(\.0)?: must be > 0"),
    (["algo.m2po_tau=-0.04"], r"algo\.m2po_tau=-0\.04: must be > 0"),
    (["algo.m2po_tau=0.04", "algo.bapo=true"], r"algo\.m2po_tau/bapo=\(0\.04, True\): .*choose one"),
    (["algo.m2po_tau=0.04", "algo.dual_clip=3"], r"algo\.dual_clip=3(\.0)?: M2PO .* replaces ratio clipping"),
    (["algo.m2po_tau=0.04", "algo.clip_high=0.28"], r"algo\.clip_low/clip_high=\(0\.2, 0\.28\): M2PO"),
    (["algo.bapo=true", "algo.clip_low=0.1"], r"algo\.clip_low/clip_high=\(0\.1, 0\.2\): BAPO .*algo\.bapo_low"),
    (["algo.bapo=true", "algo.bapo_low=[0.9,0.6]"], r"algo\.bapo_low=\[0\.9, 0\.6\]: needs 0 < start <= limit < 1"),
    (["algo.bapo=true", "algo.bapo_low=[0.6,1.1]"], r"algo\.bapo_low=\[0\.6, 1\.1\]: needs 0 < start <= limit < 1"),
    (["algo.bapo=true", "algo.bapo_high=[0.9,3.0]"], r"algo\.bapo_high=\[0\.9, 3\.0\]: needs 1 < start <= limit"),
    (["algo.bapo=true", "algo.bapo_high=[1.2]"], r"algo\.bapo_high=\[1\.2\]: must be a list of two numbers"),
    (["algo.bapo=true", "algo.bapo_steps=[0.02,0]"],
     r"algo\.bapo_steps=\[0\.02, 0(\.0)?\]: both increments must be > 0"),
    (["algo.bapo=true", "algo.bapo_rho=1.5"], r"algo\.bapo_rho=1\.5: must be in \(0, 1\)"),
    (["algo.bapo_rho=0.5"], r"algo\.bapo_rho=0\.5: is not used with algo\.bapo=False .*remove it"),
    (["algo.bapo_high=[1.1,2.0]"], r"algo\.bapo_high=\[1\.1, 2\.0\]: is not used with algo\.bapo=False .*remove it"),
    (["algo.grad_align=true"], r"algo\.grad_align='True': must be one of \['log', 'off', 'project'\]"),
    (["algo.grad_align=project", "algo.grad_align_threshold=1.0"],
     r"algo\.grad_align_threshold=1\.0: must be in \[0, 1\)"),
    (["algo.grad_align=log", "algo.grad_align_threshold=0.5"],
     r"algo\.grad_align_threshold=0\.5: is not used with algo\.grad_align=log .*remove it"),
    (["algo.grad_align_threshold=0.5"],
     r"algo\.grad_align_threshold=0\.5: is not used with algo\.grad_align=off .*remove it"),
    (["rollout.mode=sync", "rollout.lag=-1"], r"rollout\.lag=-1: must be >= 0"),
    (["rollout.lag=2"], r"rollout\.lag=2: needs rollout\.mode=sync"),
    # issue 22's episodes and service: unknown, out of range, unused, contradictory
    (["env.name=chess"], r"env\.name='chess': unknown environment; use one of .*guess"),
    (["env.name=guess", "env.max_turns=0"], r"env\.max_turns=0: must be >= 1"),
    (["env.name=guess", "env.timeout_s=0"], r"env\.timeout_s=0(\.0)?: must be > 0"),
    (["env.name=guess", "env.template=jinja"], r"env\.template='jinja': must be one of"),
    (["env.max_turns=3"], r"env\.name='': is empty, so the other env\.\* settings are unused"),
    (["env.options={k: 1}"], r"env\.name='': is empty"),
    (["env.name=guess", "rollout.mode=sync"], r"rollout\.mode='sync': env\.name=guess runs episodes in the partial"),
    (["env.name=guess", "reward.fn=math"], r"reward\.fn='math': is not used with env\.name=guess .*remove it"),
    (["rollout.mode=service", "reward.fn=math"],
     r"reward\.fn='math': is not used with rollout\.mode=service .*remove it"),
    (["service.max_episodes=8"],
     r"service\.max_episodes=8: is not used with rollout\.mode=partial .*apply only to rollout\.mode=service"),
    (["rollout.mode=service", "service.host=0.0.0.0"], r"service\.host='0\.0\.0\.0': bind to 127\.0\.0\.1"),
    (["rollout.mode=service", "service.port=70000"], r"service\.port=70000: must be a TCP port"),
    (["rollout.mode=service", "service.max_episodes=0"], r"service\.max_episodes=0: must be >= 1"),
    (["rollout.mode=service", "rollout.overlap=true"], r"rollout\.overlap=True: needs rollout\.mode=partial"),
    (["rollout.mode=service", "rollout.partial.async=true", "rollout.partial.max_staleness=1"],
     r"rollout\.partial\.async=True: needs rollout\.mode=partial"),
    (["rollout.mode=chat"], r"rollout\.mode='chat': must be one of \['partial', 'service', 'sync'\]"),
    # the engine's context holds the prompt and the response
    (["rollout.sampling.max_new_tokens=256"],
     r"rollout\.sampling\.max_new_tokens=256: must be below rollout\.engines\.max_model_len=256"),
])
def test_contradictory_settings_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("recipes/tiny_cpu.yaml", overrides)


def test_consistent_settings_still_load():
    cfg = load_config("recipes/tiny_cpu.yaml", ["rollout.engines.mode=remote", "rollout.engines.urls=[http://n:1]",
                                                "rollout.engines.api_key=k"])
    assert cfg.rollout.engines.urls == ["http://n:1"]
    assert load_config("recipes/tiny_cpu.yaml", ["rollout.engines.mode=local_servers",
                                                 "rollout.engines.api_key=k"]).rollout.engines.api_key == "k"
    assert load_config("recipes/tiny_cpu.yaml", ["reward.model_path=/rm", "reward.model_coef=0.5"])


@pytest.mark.parametrize("where", ["command line", "recipe"])
def test_the_word_off_is_a_text_settings_value_not_a_boolean(tmp_path, where):
    """YAML 1.1 reads `off` / `on` as booleans: algo.routing_replay=off and algo.grad_align=off
    (their documented values) were refused as 'False'. False in a text setting is the word off
    again; a boolean setting keeps its boolean, and a value that is no choice is still refused."""
    if where == "recipe":
        recipe = tmp_path / "r.yaml"
        recipe.write_text("algo:\n  routing_replay: off\n  grad_align: off\nweight_sync:\n  verify: off\n")
        cfg = load_config(recipe)
    else:
        cfg = load_config(None, ["algo.routing_replay=off", "algo.grad_align=off", "weight_sync.verify=off"])
    assert cfg.algo.routing_replay == "off" and cfg.algo.grad_align == "off"
    assert cfg.weight_sync.verify is False
    with pytest.raises(ConfigError, match="algo.grad_align='True'"):
        load_config(None, ["algo.grad_align=on"])
