"""A setting of a component the run does not build or read is refused with one line naming it,
the choice that leaves it unused and the fix (schema/unused.py); the same setting where the
choice reads it loads; a choice on the command line drops what the recipe set for the settings
it leaves unused (config/loader.py), while one layer setting both is refused."""
import ast
import json
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from megarl.config import ConfigError, load_config
from megarl.config.schema import RootConfig
from megarl.config.schema.checks import changed
from megarl.config.schema.unused import CHOICES, unused_settings

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
    ("algo.clip_low=0.3", "algo.policy_loss=cispo", "algo.policy_loss=ppo"),
    ("algo.dual_clip=3", "algo.policy_loss=gspo", "algo.policy_loss=ppo"),
    ("reward.overlong_penalty=0.5", "reward.overlong_buffer=0", "reward.overlong_buffer=8"),
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
    ("rollout.group_filter_max_draws=4", "rollout.group_filter=none", "rollout.group_filter=zero_variance"),
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


def _layer(path: Path, settings: list[str], parent: Path | str) -> Path:
    """A recipe at `path` over `parent` setting `settings` (key=value, as on the command line)."""
    body = OmegaConf.to_container(OmegaConf.from_dotlist(settings))
    path.write_text(OmegaConf.to_yaml({"defaults": [str(Path(parent).resolve())], **body}))
    return path


def test_a_choice_turned_off_then_on_again_keeps_what_the_first_layer_set(tmp_path):
    """Issue 45, finding 7: the parent sets the KL term's mode and kind, the child turns the term
    off, the command line turns it back on: the run trains with the parent's mode and kind."""
    parent = _layer(tmp_path / "parent.yaml", ["algo.kl_mode=loss", "algo.kl_kind=k3"], RECIPE)
    child = _layer(tmp_path / "child.yaml", ["algo.kl_coef=0"], parent)
    cfg = load_config(child, ["algo.kl_coef=0.05"])
    assert (cfg.algo.kl_mode, cfg.algo.kl_kind, cfg.algo.kl_coef) == ("loss", "k3", 0.05)
    assert not changed(load_config(child).algo, {"kl_mode", "kl_kind"})   # the child alone drops them


def _turned_back(unused_by: str, used_by: str) -> list[str]:
    """`used_by`, plus the schema's default of every key of `unused_by` it leaves out (the
    companions of the choice that turned the setting off, env.name included)."""
    given = {item.split("=", 1)[0] for item in used_by.split()}
    back = [f"{key}={json.dumps(_default(key))}"
            for key in (item.split("=", 1)[0] for item in unused_by.split()) if key not in given]
    return [*used_by.split(), *back]


def _default(key: str):
    value = OmegaConf.select(OmegaConf.structured(RootConfig), key)
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


@pytest.mark.parametrize("setting,unused_by,used_by", CASES, ids=[c[0].split("=")[0] for c in CASES])
@pytest.mark.parametrize("back_in", ["command line", "recipe"])
def test_every_choice_turned_off_then_on_again_keeps_the_setting(tmp_path, setting, unused_by, used_by, back_in):
    """Each choice of the table: a parent recipe sets a setting the choice reads, a child turns
    the choice off (which drops the parent's setting), a later layer (the command line, or a
    recipe over the child) turns it back on: the setting resolves to the parent's value, the value
    of the last layer that set it."""
    key, value = setting.split("=")
    parent = _layer(tmp_path / "parent.yaml", [*used_by.split(), setting], RECIPE)
    child = _layer(tmp_path / "child.yaml", unused_by.split(), parent)
    expected = OmegaConf.select(OmegaConf.from_dotlist([setting]), key)
    expected = OmegaConf.to_container(expected) if OmegaConf.is_config(expected) else expected
    assert _read(load_config(parent), key) == expected
    assert not changed(*_field(load_config(child), key))    # turned off: the parent's value is dropped
    if back_in == "command line":
        cfg = load_config(child, _turned_back(unused_by, used_by))
    else:
        cfg = load_config(_layer(tmp_path / "again.yaml", _turned_back(unused_by, used_by), child))
    assert _read(cfg, key) == expected


def _field(cfg, key: str):
    section, name = key.rsplit(".", 1)
    obj = cfg
    for part in section.split("."):
        obj = getattr(obj, part)
    return obj, {name}


def _read(cfg, key: str):
    obj, (name,) = _field(cfg, key)
    value = getattr(obj, name)
    return list(value) if isinstance(value, list) else value


@pytest.mark.parametrize("budget", [0, -1], ids=["rows", "derived"])
def test_a_token_budget_turned_off_again_keeps_the_parents_micro_batch_size(tmp_path, budget):
    """The same for the two ways of sizing micro-batches (config/loader.py ALTERNATIVES): the
    parent sets a row count, the child a token budget (which drops the row count), the command
    line turns the budget off (0: by rows; -1: derived, by rows when a row count is set): the
    parent's row count is back."""
    parent = _layer(tmp_path / "parent.yaml", ["train.micro_batch_size=4"], RECIPE)
    child = _layer(tmp_path / "child.yaml", ["train.max_tokens_per_micro_batch=4096"], parent)
    assert not changed(load_config(child).train, {"micro_batch_size"})
    cfg = load_config(child, [f"train.max_tokens_per_micro_batch={budget}"])
    assert (cfg.train.micro_batch_size, cfg.train.max_tokens_per_micro_batch) == (4, 0)


# where the scored-elsewhere choices leave the verifier's settings unused: the evaluation still
# runs a verifier of its own on each held-out dataset (megarl/eval/runner.py), within reward.timeout_s
SCORED_ELSEWHERE = ["env.name=guess rollout.mode=partial", "rollout.mode=service rollout.overlap=false",
                    "reward.fn=none reward.model_path=rm"]


@pytest.mark.parametrize("scored_elsewhere", SCORED_ELSEWHERE, ids=lambda s: s.split("=")[0])
def test_the_evaluations_verifier_time_limit_is_used_wherever_the_reward_comes_from(scored_elsewhere):
    """Issue 45, finding 8: reward.timeout_s bounds the evaluation's verifiers too, so with
    eval.datasets it is read under env.name, rollout.mode=service and reward.fn=none."""
    evaluated = ["eval.datasets=[held.jsonl]", "eval.verifiers=[math]"]
    cfg = load_config(RECIPE, [*scored_elsewhere.split(), *evaluated, "reward.timeout_s=3"])
    assert cfg.reward.timeout_s == 3
    with pytest.raises(ConfigError, match=r"^reward\.timeout_s=3\.0: is not used with "):
        load_config(RECIPE, [*scored_elsewhere.split(), "reward.timeout_s=3"])   # no evaluation: unused


def _sections(cls=RootConfig, prefix: str = "") -> dict[str, set[str]]:
    """Every section of the schema (dotted: rollout.engines) -> the names of its settings."""
    out = {prefix.rstrip("."): set()} if prefix else {}
    for f in fields(cls):
        if is_dataclass(getattr(f, "default_factory", None)):
            out.update(_sections(f.default_factory, f"{prefix}{f.name}."))
        elif prefix:
            out[prefix.rstrip(".")].add(f.name)
    return out


def _chain(node) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _setting(parts: list[str], sections: dict[str, set[str]]) -> str | None:
    """The section (parts naming one) or setting (a section and one of its fields) `parts` reach."""
    for cut in range(len(parts), 0, -1):
        section = ".".join(parts[:cut])
        if section in sections:
            rest = parts[cut:]
            return section if not rest else f"{section}.{rest[0]}" if rest[0] in sections[section] else None
    return None


def _config_reads(scope, sections) -> set[str]:
    """The settings `scope` (a function or module) reads: `cfg.reward.timeout_s`, `self.cfg.eval.k`,
    and `e.k` after `e = cfg.eval` (or `e, d = cfg.eval, cfg.data`)."""
    aliases, reads = {}, set()
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign):
            pairs = [(t, node.value) for t in node.targets]
            pairs += [p for t in node.targets if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple)
                      for p in zip(t.elts, node.value.elts)]
            for target, value in pairs:
                chain = _chain(value)
                if isinstance(target, ast.Name) and chain and "cfg" in chain:
                    reached = _setting(chain[len(chain) - chain[::-1].index("cfg"):], sections)
                    if reached in sections:
                        aliases[target.id] = reached
    for node in ast.walk(scope):
        chain = _chain(node) if isinstance(node, ast.Attribute) else None
        if not chain:
            continue
        if chain[0] in aliases:
            chain = ["cfg", *aliases[chain[0]].split("."), *chain[1:]]
        if "cfg" in chain:
            reached = _setting(chain[len(chain) - chain[::-1].index("cfg"):], sections)
            if reached and reached not in sections:
                reads.add(reached)
    return reads


def package_reads(package: str) -> set[str]:
    """The settings the code of megarl/<package>/ reads (per function, so an alias of one
    function is not taken for another's)."""
    sections, reads = _sections(), set()
    for path in sorted((Path(__file__).resolve().parents[2] / "megarl" / package).rglob("*.py")):
        tree = ast.parse(path.read_text())
        scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]
        for scope in scopes:
            reads |= _config_reads(scope, sections)
    return reads


# the packages a setting turns on, each with a configuration where it runs and reads the most
# (the evaluation with no eval.verifiers also reads reward.fn, the verifier it then uses)
# (megarl/envs/ reads no setting itself: train.py hands it what it needs)
RUN_WHEN = {"eval": {"eval.datasets": ["held.jsonl"]}, "service": {"rollout.mode": "service"}}


def test_the_reader_scan_sees_the_evaluations_reads():
    """The scan itself: what megarl/eval/ reads, through `cfg.` chains and aliases alike."""
    reads = package_reads("eval")
    assert {"reward.timeout_s", "reward.fn", "data.answer_key", "eval.every", "rollout.sampling.max_new_tokens",
            "run.seed"} <= reads, reads


@pytest.mark.parametrize("package", sorted(RUN_WHEN))
def test_no_setting_a_running_package_reads_is_called_unused(package):
    """Issue 45, finding 8, for the kind: under every choice of the table (each case's choices,
    both the one that leaves a setting unused and the one that reads it), with `package` turned
    on, no setting the table calls unused is one the package's code reads (an AST scan of
    megarl/<package>/ for cfg.<section>.<key> reads)."""
    reads = package_reads(package)
    assert reads, f"the scan found no setting read in megarl/{package}/"
    for choices in sorted({c for _, unused_by, used_by in CASES for c in (unused_by, used_by)}):
        cfg = load_config(RECIPE, choices.split())
        for key, value in RUN_WHEN[package].items():
            obj, (name,) = _field(cfg, key)
            setattr(obj, name, value)
        for choice, value, keys, _ in unused_settings(cfg):
            assert not keys & reads, (f"{sorted(keys & reads)}: called unused with {choice}={value} "
                                      f"(after {choices}), and megarl/{package}/ reads them when it runs")
