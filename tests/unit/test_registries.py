"""Registries (megarl.config.registry): the mechanics, the built-in entries of the PPO and reward
registries, and the promise that one `register` call is all a new entry needs: config
validation accepts its name and the code that dispatches on the setting reaches it."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from megarl.config.errors import ConfigError
from megarl.config.registry import (
    ADVANTAGES,
    IS_LEVELS,
    IS_MODES,
    KL_KINDS,
    LOSS_AGGS,
    POLICY_LOSSES,
    VERIFIERS,
    Registry,
)
from megarl.config.schema import AlgoConfig, RewardConfig
from megarl.ppo.advantages import Estimator, gae, grpo_advantages, masked_whiten, token_rewards
from megarl.ppo.aggregate import Aggregation, aggregate, global_normalizer
from megarl.ppo.correction import behaviour_weights
from megarl.ppo.losses import kl_penalty
from megarl.rewards import build_verifier, needs_answer, verifier_entry
from megarl.rewards.entry import register_verifier


@pytest.fixture
def scratch():
    """Entries registered by a test, removed afterwards (the registries are process-wide)."""
    added: list[tuple[Registry, str]] = []

    def register(reg: Registry, name: str, obj):
        reg.register(name, obj)
        added.append((reg, name))
        return obj

    yield register
    for reg, name in added:
        reg._entries.pop(name, None)


# ------------------------------------------------------------------------------------- mechanics
def test_register_check_and_get():
    reg = Registry("algo.thing", "json", "thing")   # json: a home that registers nothing

    @reg.register("b")
    def b():
        pass

    a = object()
    assert reg.register("a", a) is a
    assert reg.names() == ["a", "b"] and list(reg) == ["a", "b"] and "a" in reg and "c" not in reg
    assert reg.get("b") is b
    reg.register("a", a)                              # the same object again: harmless (a re-import)
    with pytest.raises(ValueError, match="'a' is registered twice"):
        reg.register("a", object())
    with pytest.raises(ConfigError) as e:
        reg.check("c")
    assert str(e.value).startswith("algo.thing='c': unknown thing; use one of a, b")
    with pytest.raises(ConfigError, match=r"^other\.key='c'"):
        reg.get("c", key="other.key")


def test_the_home_module_is_imported_on_first_use(tmp_path, monkeypatch):
    """The built-ins are registered by importing `home`, the first time anyone asks."""
    holder = types.ModuleType("probe_registry_holder")
    holder.REG = Registry("probe.kind", "probe_registry_home", "probe kind")
    monkeypatch.setitem(sys.modules, "probe_registry_holder", holder)
    (tmp_path / "probe_registry_home.py").write_text(
        "import probe_registry_holder\nprobe_registry_holder.REG.register('built_in', object())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "probe_registry_home" not in sys.modules
    assert holder.REG.names() == ["built_in"]
    assert "probe_registry_home" in sys.modules
    sys.modules.pop("probe_registry_home")


def test_a_home_that_fails_to_import_fails_every_time(tmp_path, monkeypatch):
    """A broken home (a typo in a verifier module) raises its ImportError on every use, never
    a later "unknown name" that would hide which import broke."""
    reg = Registry("probe.kind", "probe_registry_broken_home", "probe kind")
    (tmp_path / "probe_registry_broken_home.py").write_text("import no_such_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for _ in range(2):
        with pytest.raises(ModuleNotFoundError, match="no_such_module_anywhere"):
            reg.check("x")


# ------------------------------------------------------------------------------------- built-ins
@pytest.mark.parametrize("reg, names", [
    (KL_KINDS, ["abs", "k1", "k2", "k3"]),
    (LOSS_AGGS, ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean"]),
    (ADVANTAGES, ["grpo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"]),
    (POLICY_LOSSES, ["cispo", "gspo", "ppo"]),
    (IS_MODES, ["mask", "none", "tis"]),
    (IS_LEVELS, ["geo_sequence", "sequence", "token"]),
])
def test_ppo_registries_hold_the_built_ins(reg, names):
    assert reg.names() == names


@pytest.mark.parametrize("field, bad", [("name", "dpo"), ("kl_kind", "k9"), ("loss_agg", "sum"),
                                        ("is_mode", "trunc"), ("is_level", "seq"), ("policy_loss", "dapo")])
def test_algo_config_names_the_setting_the_value_and_the_known_names(field, bad):
    with pytest.raises(ConfigError) as e:
        AlgoConfig(**{field: bad})
    reg = {"name": ADVANTAGES, "kl_kind": KL_KINDS, "loss_agg": LOSS_AGGS, "is_mode": IS_MODES,
           "is_level": IS_LEVELS, "policy_loss": POLICY_LOSSES}[field]
    assert f"algo.{field}={bad!r}" in str(e.value)
    assert ", ".join(reg.names()) in str(e.value)


def test_verifiers_hold_the_built_ins_with_their_needs():
    assert {"countdown", "exact", "format", "math", "none"} <= set(VERIFIERS)
    assert [n for n in ("countdown", "exact", "format", "math", "none") if needs_answer(n)] == ["exact", "math"]
    assert [n for n in ("countdown", "exact", "format", "math", "none") if verifier_entry(n).isolated] == ["math"]
    with pytest.raises(ConfigError, match=r"reward\.fn='maths': unknown verifier; use one of .*math"):
        RewardConfig(fn="maths")


def test_estimators_are_the_step_maths():
    """ADVANTAGES' entries compute what the step computed inline before: GAE (+ whitening) on the
    per-token rewards with a critic, group-normalised scores without one."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(4, generator=gen)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    kl = torch.rand(4, 3, generator=gen) * mask
    values = torch.rand(4, 3, generator=gen)
    algo = AlgoConfig(kl_coef=0.1)
    ppo, grpo = ADVANTAGES.get("ppo"), ADVANTAGES.get("grpo")
    assert ppo.needs_critic and not grpo.needs_critic
    adv, ret = ppo.fn(scores, kl, mask, values, algo, 2)
    want_adv, want_ret = gae(token_rewards(scores, mask, kl, 0.1), values, mask, algo.gamma, algo.lam)
    assert torch.equal(adv, masked_whiten(want_adv, mask)) and torch.equal(ret, want_ret)
    adv, ret = grpo.fn(scores, kl, mask, None, AlgoConfig(name="grpo"), 2)
    assert ret is None and torch.equal(adv, grpo_advantages(scores, kl, mask, AlgoConfig(name="grpo"), 2))


# ------------------------------------------------------------------------------------- one place
def test_a_new_kl_kind_is_accepted_and_reached(scratch):
    scratch(KL_KINDS, "double", lambda diff: 2 * diff)
    assert AlgoConfig(kl_kind="double").kl_kind == "double"
    assert torch.equal(kl_penalty(torch.tensor([1.0, 3.0]), torch.tensor([0.5, 1.0]), "double"),
                       torch.tensor([1.0, 4.0]))


def test_a_new_loss_aggregation_is_accepted_and_reached(scratch):
    scratch(LOSS_AGGS, "max-token", Aggregation(lambda mask, max_len: 1.0, lambda loss, mask: (loss * mask).max()))
    assert AlgoConfig(loss_agg="max-token").loss_agg == "max-token"
    loss, mask = torch.tensor([[1.0, 5.0, 9.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    assert global_normalizer(mask, "max-token") == 1.0
    assert aggregate(loss, mask, "max-token", 2.0) == 2.5


def test_a_new_is_mode_and_level_are_accepted_and_reached(scratch):
    scratch(IS_MODES, "halve", lambda raw, cap, low, high: raw * 0 + 0.5)
    scratch(IS_LEVELS, "first", lambda log_w, mask: log_w[:, :1].expand_as(mask))
    assert AlgoConfig(is_mode="halve", is_level="first").is_mode == "halve"
    mask = torch.ones(1, 2)
    w, stats = behaviour_weights(torch.tensor([[0.5, 0.0]]), torch.zeros(1, 2), mask, "halve", "first", 2.0, 0.5, 2.0)
    assert torch.equal(w, torch.full((1, 2), 0.5))
    assert torch.isclose(stats["is_weight_max"], torch.exp(torch.tensor(0.5)))   # token 0's ratio on both


def test_a_new_estimator_is_accepted_and_looked_up(scratch):
    est = scratch(ADVANTAGES, "reinforce", Estimator(lambda scores, kl, mask, values, algo, g: (scores[:, None] * mask,
                                                                                                 None),
                                                     needs_critic=False))
    assert AlgoConfig(name="reinforce").name == "reinforce"
    assert ADVANTAGES.get("reinforce") is est      # what ppo_step calls (megarl.ppo.step)


def test_a_new_verifier_is_accepted_and_reached(scratch):
    calls = []

    def shout(response_text, record, *, finished, answer_key="answer"):
        calls.append(record[answer_key])
        return float(response_text.isupper())

    register_verifier("shout", needs_answer=True)(shout)
    scratch(VERIFIERS, "shout", verifier_entry("shout"))     # for the clean-up
    assert RewardConfig(fn="shout").fn == "shout" and needs_answer("shout")
    v = build_verifier("shout", timeout_s=5.0, answer_key="gold")
    assert v("LOUD", {"gold": "g"}, finished=True) == 1.0 and calls == ["g"]


def test_environments_hold_the_built_ins():
    """env.name validates against these (docs/agents.md); each entry makes an Environment."""
    from megarl.config.registry import ENVIRONMENTS
    from megarl.envs.base import Environment, env_spec
    assert {"guess", "python_tool"} <= set(ENVIRONMENTS.names())
    for name in ("guess", "python_tool"):
        assert isinstance(env_spec(name).factory(seed=0), Environment)
