"""rollout's settings in three groups (rollout.sampling / engines / partial): the nested keys
work, the flat keys of before are still accepted with one warning naming the new key, and an
unknown key is still an error."""
import warnings

import pytest

from megarl.config import ConfigError, load_config, loader


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(loader, "_warned", set())


def test_nested_keys_set_the_groups():
    cfg = load_config("recipes/tiny_cpu.yaml", ["rollout.sampling.n=3", "rollout.engines.count=2",
                                                "rollout.engines.mode=local_servers", "rollout.partial.concurrency=7",
                                                "rollout.partial.async=true"])
    r = cfg.rollout
    assert (r.sampling.n, r.engines.count, r.engines.mode, r.partial.concurrency) == (3, 2, "local_servers", 7)
    assert r.partial.asynchronous and cfg.samples_per_step == cfg.train.groups_per_step * 3


@pytest.mark.parametrize("old, new, value, read", [
    ("rollout.n", "rollout.sampling.n", "3", lambda r: r.sampling.n == 3),
    ("rollout.engine_mode", "rollout.engines.mode", "local_servers", lambda r: r.engines.mode == "local_servers"),
    ("rollout.engines", "rollout.engines.count", "2", lambda r: r.engines.count == 2),
    ("rollout.engine_timeout_s", "rollout.engines.timeout_s", "9", lambda r: r.engines.timeout_s == 9),
    ("rollout.max_model_len", "rollout.engines.max_model_len", "300", lambda r: r.engines.max_model_len == 300),
    ("rollout.concurrency", "rollout.partial.concurrency", "5", lambda r: r.partial.concurrency == 5),
    ("rollout.async", "rollout.partial.asynchronous", "true", lambda r: r.partial.asynchronous),
])
def test_an_old_flat_key_is_accepted_and_warns_once(old, new, value, read):
    with pytest.warns(FutureWarning) as seen:
        cfg = load_config("recipes/tiny_cpu.yaml", [f"{old}={value}"])
        load_config("recipes/tiny_cpu.yaml", [f"{old}={value}"])    # a second time: no second warning
    assert read(cfg.rollout)
    mine = [str(w.message) for w in seen if str(w.message).startswith(f"{old} is now")]
    assert len(mine) == 1 and f"{old} is now {new}" in mine[0] and "the command line" in mine[0]


def test_old_keys_in_a_recipe(tmp_path):
    """A recipe of before (flat rollout keys, engine_urls a YAML list) still loads."""
    recipe = tmp_path / "old.yaml"
    recipe.write_text("defaults:\n  - " + str((loader.Path("recipes") / "tiny_cpu.yaml").resolve())
                      + "\nrollout:\n  n: 2\n  engines: 2\n  engine_mode: remote\n  engine_urls:\n"
                        "    - http://a:1\n    - http://b:2\n  max_staleness: 4\n")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = load_config(str(recipe)).rollout
    assert (r.sampling.n, r.engines.count, r.partial.max_staleness) == (2, 2, 4)
    assert r.engines.urls == ["http://a:1", "http://b:2"]
    assert r.engines.pool_size == 2
    assert any("rollout.engine_urls is now rollout.engines.urls" in str(w.message) and "old.yaml" in str(w.message)
               for w in seen)


def test_an_old_and_its_new_key_together_is_an_error():
    with pytest.raises(ConfigError, match=r"rollout\.n and rollout\.sampling\.n are both set.*"
                                          r"keep rollout\.sampling\.n"):
        load_config(None, ["rollout.n=2", "rollout.sampling.n=3"])


def test_an_old_key_errors_under_its_new_name():
    """A bad value given by an old key: the error names the key to write now."""
    with pytest.raises(ConfigError, match=r"rollout\.engines\.tp=0: must be >= 1"):
        load_config(None, ["rollout.engine_tp=0"])


@pytest.mark.parametrize("key", ["rollout.sampling.temprature=1", "rollout.engines.size=2", "rollout.nn=2",
                                 "rollout.partial.n=2"])
def test_an_unknown_key_is_still_an_error(key):
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout\."):
        load_config(None, [key])


def test_a_plain_value_for_a_group_is_named():
    with pytest.raises(ConfigError, match=r"rollout\.sampling is a section of settings"):
        load_config(None, ["rollout.sampling=4"])
