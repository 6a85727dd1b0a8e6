"""The evaluation's maths (megarl/eval/scores.py), its schedule (eval/schedule.py), its answer
extractors (eval/answers.py) and the eval.* settings' checks."""
import itertools
import json
import math

import pytest

from megarl.config import ConfigError
from megarl.config.loader import load_config
from megarl.eval.answers import countdown_answer, extractor_of, final_answer
from megarl.eval.datasets import load_eval_sets
from megarl.eval.schedule import due, planned
from megarl.eval.scores import dataset_scores, majority_correct, pass_at_k, prompt_scores


def brute_pass_at_k(correct: list[bool], k: int) -> float:
    """The share of the k-subsets of the samples holding a correct one: what pass@k estimates."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(n):
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(correct, k), abs=1e-12), (n, c, k)


def test_pass_at_k_stays_finite_for_large_n_and_matches_the_binomial_formula():
    n, c, k = 2000, 7, 100
    want = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(want, rel=1e-9)
    assert pass_at_k(n, 0, k) == 0.0 and pass_at_k(n, n, 1) == 1.0


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_majority_vote_takes_the_most_frequent_stated_answer():
    # "7" twice (wrong), "8" once (right): the majority is wrong
    assert majority_correct(["7", "8", "7", None], [False, True, False, False]) == 0.0
    # None never votes: "8" wins over nothing stated
    assert majority_correct([None, "8", None], [False, True, False]) == 1.0
    # a tie goes to the answer stated first
    assert majority_correct(["8", "7"], [True, False]) == 1.0
    assert majority_correct(["7", "8"], [False, True]) == 0.0
    assert majority_correct([None, None], [False, False]) == 0.0
    with pytest.raises(ValueError):
        majority_correct(["1"], [True, False])


def test_prompt_and_dataset_scores():
    rewards = [1.0, 0.5, 0.0, 1.0]
    got = prompt_scores(rewards, 1.0, [1, 2], ["a", "b", "c", "a"])
    assert got["mean@4"] == pytest.approx(sum(rewards) / 4)
    assert got["pass@1"] == pytest.approx(brute_pass_at_k([r >= 1.0 for r in rewards], 1))
    assert got["pass@2"] == pytest.approx(brute_pass_at_k([r >= 1.0 for r in rewards], 2))
    assert got["maj@4"] == 1.0
    # a lower threshold counts the partial reward as correct
    assert prompt_scores(rewards, 0.5, [1])["pass@1"] == pytest.approx(3 / 4)
    assert "maj@4" not in prompt_scores(rewards, 1.0, [1])   # no answers: no majority
    both = dataset_scores([{"pass@1": 1.0, "mean@2": 0.5}, {"pass@1": 0.0, "mean@2": 0.25}])
    assert both == {"pass@1": 0.5, "mean@2": 0.375}
    assert dataset_scores([]) == {}


def test_the_schedule_evaluates_at_start_every_and_end():
    assert planned(0, 4, 2) == [0, 2, 4]
    assert planned(0, 5, 2) == [0, 2, 4, 5]
    assert planned(0, 5, 0) == [0, 5]                       # every=0: before training and at the end
    assert planned(0, 5, 2, at_start=False) == [2, 4, 5]
    assert not due(0, 2, 4, at_start=False) and due(4, 0, 4)


@pytest.mark.parametrize("every,steps", [(2, 7), (3, 9), (0, 4), (5, 3)])
def test_a_resumed_run_keeps_the_schedule(every, steps):
    """A run resumed at step s evaluates exactly what an uninterrupted one does from s on."""
    whole = planned(0, steps, every)
    for start in range(steps + 1):
        assert planned(start, steps, every) == [v for v in whole if v >= start]


def test_answer_extractors():
    assert final_answer("so \\boxed{1,000.}", True) == "1000"
    assert final_answer("no answer here", True) is None
    assert countdown_answer("n3 n2 n1 <eos> junk", False) == "n3 n2 n1 <eos>"
    assert countdown_answer("n3 n2", False) == "n3 n2"          # unfinished: a different answer
    assert countdown_answer("n3 n2", True) == "n3 n2 <eos>"
    assert countdown_answer("   ", True) is None
    assert extractor_of("math") is final_answer and extractor_of("countdown") is countdown_answer
    assert extractor_of("format") is None


def test_a_verifier_outside_megarl_opts_into_majority_votes(tmp_path):
    (tmp_path / "myverifier.py").write_text(
        "def score(response_text, record, *, finished):\n    return 1.0\n"
        "score.extract_answer = lambda text, finished: text.strip()[:1] or None\n")
    extract = extractor_of(f"{tmp_path / 'myverifier.py'}:score")
    assert extract is not None and extract(" 42", True) == "4"


def _load(*overrides):
    return load_config("recipes/tiny_cpu.yaml", list(overrides))


@pytest.mark.parametrize("overrides,named", [
    (("eval.every=2",), "eval.every=2"),
    (("eval.n=4",), "eval.n=4"),
    (("eval.datasets=[a.jsonl]", "eval.k=[1,8]", "eval.n=4", "eval.temperature=1.0"), "eval.k=[1, 8]"),
    (("eval.datasets=[a.jsonl]", "eval.n=4"), "eval.n=4"),                       # greedy draws one response
    (("eval.datasets=[a=x.jsonl,a=y.parquet]",), "eval.datasets="),             # two named 'a'
    (("eval.datasets=[x/a.jsonl,x/a.jsonl]",), "eval.datasets="),                # one file twice
    (("eval.datasets=[a.jsonl,b.jsonl]", "eval.verifiers=[math,exact,exact]"), "eval.verifiers="),
    (("eval.datasets=[a.jsonl]", "eval.verifiers=[nope]"), "eval.verifiers[0]='nope'"),
    (("eval.datasets=[a.jsonl]", "eval.temperature=-1"), "eval.temperature=-1"),
    (("eval.datasets=[a.jsonl]", "eval.max_new_tokens=256"), "eval.max_new_tokens=256"),  # the context is 256
    (("eval.datasets=[a.jsonl]", "eval.top_p=0.9"), "eval.top_p=0.9"),          # greedy has no nucleus
    (("eval.datasets=[a.jsonl]", "eval.temperature=1", "eval.top_p=0"), "eval.top_p=0"),
    (("eval.datasets=[a.jsonl]", "rollout.partial.async=true", "rollout.partial.max_step_multiple=1"),
     "rollout.update_mode='keep'"),
    (("eval.datasets=[a.jsonl]", "reward.fn=none", "reward.model_path=rm"), "eval.verifiers=[]"),
])
def test_bad_eval_settings_are_one_line_naming_the_setting(overrides, named):
    with pytest.raises(ConfigError) as err:
        _load(*overrides)
    message = str(err.value)
    assert named in message and "\n" not in message, message


def test_good_eval_settings_load():
    cfg = _load("eval.datasets=[a.jsonl,b.parquet]", "eval.verifiers=[math]", "eval.every=2", "eval.n=4",
                "eval.k=[1,4]", "eval.temperature=0.6", "eval.top_p=0.95", "eval.max_new_tokens=200",
                "rollout.partial.async=true", "rollout.update_mode=abort")
    assert cfg.eval.names == ["a", "b"]
    assert [cfg.eval.verifier_of(i, cfg.reward.fn) for i in (0, 1)] == ["math", "math"]
    assert _load("eval.datasets=[a.jsonl]").eval.verifier_of(0, "countdown") == "countdown"
    # async keep mode with elastic steps (the default): the round ends only when its step asks
    assert _load("eval.datasets=[a.jsonl]", "rollout.partial.async=true").rollout.update_mode == "keep"


def test_eval_dataset_names_are_unique_by_path_or_explicit():
    """Two files of one name are told apart by their folders; `NAME=path` names a dataset."""
    cfg = _load("eval.datasets=[data/gsm8k/test.jsonl,data/math/test.parquet,held=data/math/other.jsonl]")
    assert cfg.eval.names == ["gsm8k_test", "math_test", "held"]
    assert cfg.eval.paths == ["data/gsm8k/test.jsonl", "data/math/test.parquet", "data/math/other.jsonl"]
    assert _load("eval.datasets=[a/test.jsonl,test.jsonl]").eval.names == ["a_test", "test"]
    assert _load("eval.datasets=[x/a=b.jsonl]").eval.paths == ["x/a=b.jsonl"]   # a path with '=' stays one


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_datasets_are_read_as_data_prompts_and_named_in_errors(tmp_path, caplog):
    good = _write(tmp_path / "held.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)])
    sets = load_eval_sets(_load(f"eval.datasets=[{good}]", "eval.max_prompts=3", "eval.verifiers=[math]"),
                          training=[{"prompt": "q1"}, {"prompt": "other"}])
    assert [(s.name, s.verifier, len(s.records)) for s in sets] == [("held", "math", 3)]
    named = load_eval_sets(_load(f"eval.datasets=[mine={good}]", "eval.verifiers=[math]"))[0]
    assert (named.name, named.path, len(named.records)) == ("mine", str(good), 5)
    assert "1 of its 3 prompts are also in data.prompts" in caplog.text
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError, match=r"^eval\.datasets\[1\]='.*nope\.jsonl' does not exist"):
        load_eval_sets(_load(f"eval.datasets=[{good},{missing}]"))
    # math compares with a gold answer: a row without one is named before anything starts
    bad = _write(tmp_path / "noanswer.jsonl", [{"prompt": "q"}])
    with pytest.raises(ConfigError, match=r"eval\.datasets\[0\]='.*noanswer\.jsonl', row 1: no field 'answer'"):
        load_eval_sets(_load(f"eval.datasets=[{bad}]", "eval.verifiers=[math]"))
    # countdown's record needs no answer field check at load (it reads record["answer"] itself)
    assert load_eval_sets(_load(f"eval.datasets=[{good}]"))[0].verifier == "countdown"


def test_chat_rows_of_an_eval_dataset_need_the_models_chat_template(tmp_path, tiny_model):
    """The tiny model's tokenizer has no chat template: a chat row is named before anything starts."""
    chat = _write(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "n5 ="}]}])
    with pytest.raises(ConfigError, match=r"eval\.datasets\[0\]='.*chat\.jsonl' hold chat messages"):
        load_eval_sets(_load(f"model.path={tiny_model}", f"eval.datasets=[{chat}]"))
