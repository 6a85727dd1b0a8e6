"""Settings that name code outside megarl by import path (megarl/config/extension.py):
`package.module:attr` or `path/to/file.py:attr`. A good path is loaded and reached by the code
that dispatches on the setting (the verifier in its worker process too); each bad path is one
ConfigError line naming the setting, the value and the fix, raised when the config is built."""
import sys
import textwrap

import pytest
import torch

from megarl.config.errors import ConfigError
from megarl.config.registry import ADVANTAGES, ENVIRONMENTS, KL_KINDS, VERIFIERS
from megarl.config.schema import AlgoConfig, EnvConfig, RewardConfig
from megarl.envs.base import Environment, env_spec
from megarl.ppo.losses import kl_penalty
from megarl.rewards import build_verifier, needs_answer, verifier_entry

USER_CODE = '''
import sys

from megarl.envs.base import Environment, StepResult
from megarl.ppo.advantages import Estimator
from megarl.rewards import verifier


@verifier(needs_answer=True, isolated=True)
def where(response_text, record, *, finished, answer_key="answer"):
    """Where it ran: the worker process of an isolated verifier is a `python -c` child."""
    return float(sys.argv[0] == "-c") + 10.0 * (record[answer_key] in response_text)


def plain(response_text, record, *, finished):
    return float(len(response_text))


def no_record(response_text):
    return 1.0


@verifier(batched=True)
def lengths(response_texts, records, *, finished):
    return [float(len(t)) for t in response_texts]


@verifier(batched=True)
def batch_no_finished(response_texts, records):
    return [1.0] * len(response_texts)


@verifier(isolated=True)
async def isolated_async(response_text, record, *, finished):
    return 1.0


def double_kl(diff):
    return 2 * diff


def two_args(a, b):
    return a


REINFORCE = Estimator(lambda scores, kl, mask, values, algo, g: (scores[:, None] * mask, None), needs_critic=False)


class Echo(Environment):
    """Says the turn back once, then ends with reward 1."""
    async def step(self, turn):
        return StepResult(observation=turn, reward=1.0, done=bool(self.options.get("once")))


class Unfinished(Environment):
    pass


class NotAnEnvironment:
    pass


NOT_CALLABLE = 3
'''


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user_code")
    path = folder / "my_extensions.py"
    path.write_text(USER_CODE)
    (folder / "broken.py").write_text("import no_such_module_xyz\n")
    return path


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """The same code as an importable package (megarl_user_pkg.ext), on sys.path for this test."""
    pkg = tmp_path / "megarl_user_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ext.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "megarl_user_pkg.ext"
    for name in [n for n in sys.modules if n.startswith("megarl_user_pkg")]:
        sys.modules.pop(name)


# ------------------------------------------------------------------------------------ good paths
def test_a_verifier_from_a_file_runs_in_its_worker_process_with_the_answer(user_file):
    """reward.fn=path/to/file.py:where, marked isolated and needing the answer: the config accepts
    it, and the run's Verifier calls it in a worker process that loaded the same file (a
    function of a file-loaded module is unpickled there by its module name)."""
    value = f"{user_file}:where"
    assert RewardConfig(fn=value).fn == value and needs_answer(value) and verifier_entry(value).isolated
    v = build_verifier(value, timeout_s=60.0, answer_key="gold")
    try:
        assert v("the n3 here", {"gold": "n3"}, finished=True) == 11.0    # in the worker, answer found
        assert v.take_counts() == {"reward_errors": 0, "reward_timeouts": 0}
    finally:
        v.close()
    assert value not in VERIFIERS.names()          # the registered names stay the built-in ones


def test_a_batched_verifier_by_import_path_resolves_as_batched(user_file):
    """One resolution point for every kind: @verifier(batched=True) in a file is read as batched,
    and the run's runner hands it whole groups, the scores back in order."""
    value = f"{user_file}:lengths"
    entry = verifier_entry(value)
    assert entry.batched and not entry.is_async and not entry.isolated
    v = build_verifier(value, timeout_s=30.0, batch_size=4)
    try:
        assert v.score_groups([(["a", "bb"], [{}, {}], [True, True]), (["ccc"], [{}], [False])]) == [[1.0, 2.0], [3.0]]
        assert v.take_counts() == {"reward_errors": 0, "reward_timeouts": 0}
    finally:
        v.close()


def test_a_verifier_from_a_package_and_a_relative_file_path(user_package, user_file, monkeypatch):
    value = f"{user_package}:plain"
    entry = verifier_entry(value)
    assert not entry.needs_answer and not entry.isolated      # unmarked: in this process, no answer
    assert build_verifier(value, timeout_s=5.0)("abc", {}, finished=True) == 3.0
    isolated = build_verifier(f"{user_package}:where", timeout_s=60.0)   # the worker imports the package
    try:
        assert isolated("n3", {"answer": "n4"}, finished=True) == 1.0
    finally:
        isolated.close()
    monkeypatch.chdir(user_file.parent)
    assert verifier_entry("my_extensions.py:plain").fn("ab", {}, finished=False) == 2.0
    # the file is one module however it is named: loaded once
    assert verifier_entry("my_extensions.py:plain").fn is verifier_entry(f"{user_file}:plain").fn


def test_an_environment_kl_kind_and_estimator_by_import_path(user_file, user_package):
    env_name = f"{user_file}:Echo"
    assert EnvConfig(name=env_name, options={"once": True}).name == env_name
    env = env_spec(env_name).factory(seed=3, once=True)
    assert isinstance(env, Environment) and env.seed == 3 and env_name in ENVIRONMENTS
    kl = f"{user_package}:double_kl"
    assert AlgoConfig(kl_kind=kl, kl_coef=0.1).kl_kind == kl
    assert torch.equal(kl_penalty(torch.tensor([1.0, 3.0]), torch.tensor([0.5, 1.0]), kl), torch.tensor([1.0, 4.0]))
    est = f"{user_file}:REINFORCE"
    assert AlgoConfig(name=est).name == est and not ADVANTAGES.get(est).needs_critic
    assert KL_KINDS.names() == ["abs", "k1", "k2", "k3"]


# ------------------------------------------------------------------------------------- bad paths
BAD = [
    # (config, field, value as formatted with {file} / {dir}, what the message says)
    (RewardConfig, "fn", "{dir}/missing.py:score", "there is no file {dir}/missing.py"),
    (RewardConfig, "fn", "megarl_no_such_pkg.mod:score", "no module named 'megarl_no_such_pkg' can be imported "
                                                         "here: install it, put the folder holding it on PYTHONPATH"),
    (RewardConfig, "fn", "{dir}/broken.py:score", "loading {dir}/broken.py failed: ModuleNotFoundError"),
    (RewardConfig, "fn", "{file}:scorer", "has no attribute 'scorer'"),
    (RewardConfig, "fn", "{file}:no_record", "has the signature (response_text), but megarl calls it as "
                                             "fn(response_text, record, *, finished)"),
    (RewardConfig, "fn", "{file}:NOT_CALLABLE", "is an int, not a function"),
    (RewardConfig, "fn", "{file}:batch_no_finished", "has the signature (response_texts, records), but megarl "
                                                     "calls it as fn(response_texts, records, *, finished)"),
    (RewardConfig, "fn", "{file}:isolated_async", "is an async function marked isolated: a worker process runs "
                                                  "plain functions"),
    (RewardConfig, "fn", "{file}:", "is not an import path: write package.module:attr or path/to/file.py:attr"),
    (EnvConfig, "name", "{file}:NotAnEnvironment", "is the class NotAnEnvironment, not a subclass of "
                                                   "megarl.envs.base.Environment"),
    (EnvConfig, "name", "{file}:plain", "is a function, not a subclass of megarl.envs.base.Environment"),
    (EnvConfig, "name", "{file}:Unfinished", "does not define step"),
    (AlgoConfig, "kl_kind", "{file}:two_args", "has the signature (a, b), but megarl calls it as two_args(diff)"),
    (AlgoConfig, "name", "{file}:double_kl", "is a function, not a megarl.ppo.advantages.Estimator"),
    (AlgoConfig, "loss_agg", "{file}:REINFORCE", "is an Estimator, not a megarl.ppo.aggregate.Aggregation"),
    (AlgoConfig, "is_mode", "{file}:double_kl", "but megarl calls it as double_kl(raw, cap, low, high)"),
]


@pytest.mark.parametrize("config, field, value, says", BAD, ids=[f"{c.__name__}.{f}:{v.split(':')[-1] or 'empty'}"
                                                                  for c, f, v, _ in BAD])
def test_each_bad_path_is_one_line_naming_the_setting_value_and_fix(user_file, config, field, value, says):
    value = value.format(file=user_file, dir=user_file.parent)
    extra = {"kl_coef": 0.1} if field == "kl_kind" else {}
    with pytest.raises(ConfigError) as e:
        config(**{field: value}, **extra)
    key = {RewardConfig: "reward", EnvConfig: "env", AlgoConfig: "algo"}[config]
    msg = str(e.value)
    assert msg.startswith(f"{key}.{field}={value!r}: "), msg
    assert says.format(file=user_file, dir=user_file.parent) in msg and "\n" not in msg


def test_an_isolated_verifier_must_travel_by_name(tmp_path):
    """An isolated verifier runs in a worker process: one that cannot be pickled by reference
    (made in a function) is refused at load time, not at the first sample."""
    path = tmp_path / "nested.py"
    path.write_text(textwrap.dedent("""
        from megarl.rewards import verifier

        def make():
            def inner(response_text, record, *, finished):
                return 1.0
            return verifier(isolated=True)(inner)

        score = make()
    """))
    with pytest.raises(ConfigError, match=r"^reward\.fn='.*nested\.py:score': is isolated \(runs in a worker "
                                          r"process\), so it must be a module-level function"):
        RewardConfig(fn=f"{path}:score")


def test_unknown_names_mention_the_import_path_form():
    with pytest.raises(ConfigError, match=r"^reward\.fn='maths': unknown verifier; use one of .*, or your own as "
                                          r"package\.module:attr or path/to/file\.py:attr"):
        RewardConfig(fn="maths")


def test_the_docs_examples_load_by_the_paths_the_docs_give(monkeypatch):
    """docs/data.md and docs/agents.md name examples/my_rl_code.py's verifier and environment."""
    from conftest import ROOT
    monkeypatch.chdir(ROOT)
    for doc, setting in (("docs/data.md", "reward.fn=examples/my_rl_code.py:short_score"),
                         ("docs/agents.md", "env.name=examples/my_rl_code.py:KeywordEnv")):
        assert setting in (ROOT / doc).read_text()
    assert verifier_entry("examples/my_rl_code.py:short_score").fn("ok", {}, finished=True) == 1.0
    env = env_spec(EnvConfig(name="examples/my_rl_code.py:KeywordEnv").name).factory(seed=0)
    assert isinstance(env, Environment)
