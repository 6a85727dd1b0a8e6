"""A setting of a component the run does not build or read is refused with one line naming it,
the choice that leaves it unused and the fix (schema/unused.py); the same setting where the
choice reads it loads; a choice on the command line drops what the recipe set for the settings
it leaves unused (config/loader.py), while one layer setting both is refused."""
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config
from megarl.config.schema.checks import changed
from megarl.config.schema.unused import CHOICES

RECIPE = "recipes/tiny_cpu.yaml"

# (the unused setting, the choice that leaves it unused, a choice that reads it)
CASES = [
    ("train.critic_lr=1e-5", "algo.name=grpo", "algo.name=ppo"),
    ("train.critic_warmup_steps=2", "algo.name=grpo", "algo.name=ppo"),
    ("algo.value_clip=0.5", "algo.name=grpo", "algo.name=ppo"),
    ("algo.value_coef=0.5", "algo.name=grpo", "algo.name=ppo"),
    ("algo.lam=0.9", "algo.name=grpo", "algo.name=ppo"),
    ("algo.gamma=0.99", "algo.name=grpo", "algo.name=ppo"),
    ("algo.whiten_advantages=false", "algo.name=grpo", "algo.name=ppo"),
    ("algo.grpo_std_normalize=false", "algo.name=ppo", "algo.name=grpo"),
    ("algo.kl_mode=loss", "algo.kl_coef=0", "algo.kl_coef=0.01"),
    ("algo.kl_kind=k3", "algo.kl_coef=0", "algo.kl_coef=0.01"),
    ("algo.is_cap=3", "algo.is_mode=mask", "algo.is_mode=tis"),
    ("algo.is_low=0.2", "algo.is_mode=tis", "algo.is_mode=mask"),
    ("algo.is_high=3", "algo.is_mode=none", "algo.is_mode=mask"),
    ("algo.grad_align_threshold=0.5", "algo.grad_align=log", "algo.grad_align=project"),
    ("algo.bapo_rho=0.5", "algo.bapo=false", "algo.bapo=true"),
    ("algo.bapo_steps=[0.01,0.02]", "algo.bapo=false", "algo.bapo=true"),
    ("train.min_lr_ratio=0.2", "train.lr_decay_style=constant", "train.lr_decay_style=cosine"),
    ("rollout.partial.concurrency=8", "rollout.mode=sync", "rollout.mode=partial"),
    ("rollout.partial.max_staleness=1", "rollout.mode=sync", "rollout.mode=partial"),
    ("rollout.partial.stale_policy=drop", "rollout.mode=sync", "rollout.mode=partial"),
    ("rollout.update_mode=abort", "rollout.mode=sync", "rollout.mode=partial"),
    ("weight_sync.staging_dir=/tmp/stage", "weight_sync.transport=collective", "weight_sync.transport=files"),
    ("weight_sync.num_buffers=3", "weight_sync.transport=files", "weight_sync.transport=collective"),
    ("weight_sync.master_port=29999", "weight_sync.transport=files", "weight_sync.transport=collective"),
    ("weight_sync.backend=gloo", "weight_sync.transport=files", "weight_sync.transport=collective"),
    ("reward.timeout_s=3", "reward.fn=none reward.model_path=rm", "reward.fn=countdown"),
    ("service.max_episodes=8", "rollout.mode=partial", "rollout.mode=service"),
    ("reward.timeout_s=3", "env.name=guess rollout.mode=partial", "rollout.mode=partial"),
    ("rollout.engines.expert_parallel=true", "rollout.engines.mode=remote rollout.engines.urls=[http://node1:8000] "
     "rollout.engines.tp=2", "rollout.engines.mode=local_servers rollout.engines.tp=2"),
]


@pytest.mark.parametrize("setting,unused_by,used_by", CASES, ids=[c[0].split("=")[0] for c in CASES])
def test_unused_setting_is_refused_and_used_one_loads(setting, unused_by, used_by):
    key, value = setting.split("=")
    with pytest.raises(ConfigError) as err:
        load_config(RECIPE, [*unused_by.split(), setting])
    line = str(err.value)
    choice = unused_by.split()[0].split("=")[0]
    assert line.startswith(f"{key}=") and "\n" not in line
    assert f"{choice}=" in line and "remove it" in line
    cfg = load_config(RECIPE, [*used_by.split(), setting])   # where it is read, it loads and holds
    section, name = key.rsplit(".", 1)
    obj = cfg
    for part in section.split("."):
        obj = getattr(obj, part)
    assert changed(obj, {name}) == [name]


def test_every_choice_has_a_case():
    """A choice added to CHOICES without a case here is untested."""
    assert {u.split()[0].split("=")[0] for _, u, _ in CASES} == set(CHOICES)


def test_offload_idle_with_nothing_idle_is_refused():
    with pytest.raises(ConfigError, match=r"^train\.offload_idle=True: .*builds none"):
        load_config(RECIPE, ["algo.name=grpo", "train.offload_idle=true"])
    assert load_config(RECIPE, ["algo.name=grpo", "algo.kl_coef=0.01", "train.offload_idle=true"]).train.offload_idle


def test_a_choice_on_the_command_line_drops_the_recipes_unused_settings(tmp_path):
    """The recipe sets PPO's critic learning rate; algo.name=grpo on the command line drops it
    (it would be unused), as a later layer replaces a key; the recipe alone still has it."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"defaults: [{Path(RECIPE).resolve()}]\n"
                      "train:\n  critic_lr: 2.0e-5\nrollout:\n  partial:\n    concurrency: 8\n")
    assert load_config(recipe).train.critic_lr == 2e-5
    cfg = load_config(recipe, ["algo.name=grpo", "rollout.mode=sync"])
    assert cfg.algo.name == "grpo" and cfg.rollout.mode == "sync"
    assert not changed(cfg.train, {"critic_lr"}) and not changed(cfg.rollout.partial, {"concurrency"})


def test_turning_an_option_off_on_the_command_line_drops_its_settings(tmp_path):
    """Options whose settings only they read (algo.grad_align=project's threshold, algo.bapo's
    bounds) are choices like the others: the command line turning one off drops what the recipe
    set for it, and one layer setting both is refused."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"defaults: [{Path(RECIPE).resolve()}]\n"
                      "algo:\n  grad_align: project\n  grad_align_threshold: 0.5\n"
                      "  bapo: true\n  bapo_rho: 0.5\n")
    on = load_config(recipe)
    assert changed(on.algo, {"grad_align_threshold", "bapo_rho"}) == ["bapo_rho", "grad_align_threshold"]
    cfg = load_config(recipe, ["algo.grad_align=log", "algo.bapo=false"])
    assert cfg.algo.grad_align == "log" and not cfg.algo.bapo
    assert not changed(cfg.algo, {"grad_align_threshold", "bapo_rho"})
    with pytest.raises(ConfigError, match=r"^algo\.bapo_rho=0\.5: .*algo\.bapo=False"):
        load_config(RECIPE, ["algo.bapo=false", "algo.bapo_rho=0.5"])


def test_leaving_service_mode_on_the_command_line_drops_the_service_settings(tmp_path):
    """service.* and reward.fn answer to rollout.mode and env.name as every other choice's
    settings do: the command line leaving rollout.mode=service drops the recipe's service.*,
    naming an environment drops the recipe's reward.fn."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"defaults: [{Path(RECIPE).resolve()}]\n"
                      "rollout:\n  mode: service\nservice:\n  max_episodes: 8\n")
    assert load_config(recipe).service.max_episodes == 8
    cfg = load_config(recipe, ["rollout.mode=partial"])
    assert cfg.rollout.mode == "partial" and not changed(cfg.service, {"max_episodes"})
    with pytest.raises(ConfigError, match=r"^service\.max_episodes=8: .*rollout\.mode=partial"):
        load_config(RECIPE, ["rollout.mode=partial", "service.max_episodes=8"])
    fn = tmp_path / "fn.yaml"
    fn.write_text(f"defaults: [{Path(RECIPE).resolve()}]\nreward:\n  fn: math\n")
    cfg = load_config(fn, ["env.name=guess", "rollout.mode=partial"])
    assert cfg.env.name == "guess" and not changed(cfg.reward, {"fn"})
