"""Verifiers: math (math-verify), exact, format; and the runner that turns a verifier's error or
hang into a 0 that is counted. Worker-process tests take a few seconds (a fresh interpreter)."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest
from conftest import ROOT

from megarl.config import ConfigError
from megarl.config.registry import VERIFIERS
from megarl.config.schema import RewardConfig
from megarl.rewards import RewardOutputError, RewardRunner, VerifierEntry, build_verifier, needs_answer, verifier_entry
from megarl.rewards.answer import exact_score, extract_answer, format_score, normalize
from megarl.rewards.verify import Verifier, Worker, WorkerStartError


# ------------------------------------------------------------------------------------- answers
def test_extract_answer_formats():
    """The last \\boxed{} (braces nested) wins, then the last `answer:` line; none: None."""
    assert extract_answer("so \\boxed{1} no wait \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert extract_answer("Answer: 42\nthat's it") == "42"
    assert extract_answer("first answer: 3\nFinal answer: 4") == "4"
    assert extract_answer("\\boxed{12} and answer: 13") == "12"      # boxed wins
    assert extract_answer("the result is 12") is None
    assert extract_answer("\\boxed{12") is None                        # cut inside the answer
    assert extract_answer("answer:   ") is None


def test_exact_normalises_formatting_only():
    rec = {"answer": "1,000"}
    assert exact_score("The answer is \\boxed{1000}", rec, finished=True) == 1.0
    assert exact_score("Answer: $1,000$.", rec, finished=True) == 1.0
    assert exact_score("1000", rec, finished=True) == 1.0             # no marker: the whole response
    assert exact_score("\\boxed{1001}", rec, finished=True) == 0.0
    assert exact_score("answer: PARIS", {"city": "Paris"}, finished=True, answer_key="city") == 1.0
    assert exact_score("", {"answer": "x"}, finished=False) == 0.0
    assert normalize("  New   York. ") == "new york"


def test_format_rewards_a_stated_answer():
    assert format_score("\\boxed{3}", {}, finished=True) == 1.0
    assert format_score("so the answer: 3", {}, finished=True) == 1.0
    assert format_score("it is 3", {}, finished=True) == 0.0


# ------------------------------------------------------------------------------------- math
@pytest.fixture(scope="module")
def math_verifier():
    v = build_verifier("math", timeout_s=20.0)
    yield v
    v.close()


@pytest.mark.parametrize("gold,response,want", [
    ("1/2", "0.5", 1.0),
    ("\\frac{1}{2}", "The answer is $\\boxed{0.5}$", 1.0),
    ("0.5", "so we get \\boxed{\\frac{1}{2}}", 1.0),
    ("x^2 + 2x + 1", "\\boxed{(x+1)^2}", 1.0),
    ("3x^2", "$\\boxed{3 x^{2}}$", 1.0),
    ("12", "\\boxed{13}", 0.0),
    ("12", "n5 n4 n3 n2 n1", 0.0),        # what the tiny model says
    ("12", "", 0.0),
])
def test_math_equivalences(math_verifier, gold, response, want):
    assert math_verifier(response, {"answer": gold}, finished=True) == want
    assert math_verifier.take_counts() == {"reward_errors": 0, "reward_timeouts": 0}


def test_math_sample_answers_verify_against_themselves(math_verifier):
    """Every gold answer of the shipped sample parses: a boxed copy of it scores 1."""
    rows = [json.loads(line) for line in (ROOT / "tests/data/math_sample.jsonl").read_text().splitlines()]
    for r in rows:
        assert math_verifier(f"\\boxed{{{r['answer']}}}", r, finished=True) == 1.0, r["answer"]
    assert math_verifier.take_counts() == {"reward_errors": 0, "reward_timeouts": 0}
    assert [w.starts for w in math_verifier.workers] == [1]     # one worker for every call


def test_math_unparseable_gold_is_a_counted_error(math_verifier):
    assert math_verifier("\\boxed{1}", {"answer": "\\\\\\"}, finished=True) == 0.0
    assert math_verifier.take_counts() == {"reward_errors": 1, "reward_timeouts": 0}


# ------------------------------------------------------------------------------------- runner
def raising_verifier(response_text, record, *, finished):
    raise RuntimeError("verifier bug")


def hanging_verifier(response_text, record, *, finished):
    if response_text == "hang":
        time.sleep(600)
    return 1.0


def dying_verifier(response_text, record, *, finished):
    if response_text == "die":
        os._exit(3)     # a crash in C code looks the same from outside
    return 1.0


def nan_verifier(response_text, record, *, finished):
    return float("nan")


def slow_verifier(response_text, record, *, finished):
    time.sleep(0.3)
    return 1.0


@pytest.mark.parametrize("isolate", [False, True])
def test_a_raising_verifier_scores_zero_and_is_counted(isolate):
    v = Verifier(raising_verifier, timeout_s=10, isolate=isolate)
    try:
        assert v("x", {}, finished=True) == 0.0
        assert v("y", {}, finished=True) == 0.0
        assert v.take_counts() == {"reward_errors": 2, "reward_timeouts": 0}
        assert v.take_counts() == {"reward_errors": 0, "reward_timeouts": 0}   # per step
    finally:
        v.close()


def test_a_hanging_verifier_scores_zero_within_the_timeout_and_the_next_call_works():
    v = Verifier(hanging_verifier, timeout_s=1.0, isolate=True)
    try:
        assert v("fine", {}, finished=True) == 1.0          # worker started (not timed)
        t0 = time.monotonic()
        assert v("hang", {}, finished=True) == 0.0
        assert time.monotonic() - t0 < 3.0
        assert v.take_counts() == {"reward_errors": 0, "reward_timeouts": 1}
        assert v("fine", {}, finished=True) == 1.0          # a fresh worker
        assert v._worker.starts == 2
    finally:
        v.close()


def test_a_worker_dying_mid_call_is_a_counted_error_and_replaced():
    v = Verifier(dying_verifier, timeout_s=10, isolate=True)
    try:
        assert v("die", {}, finished=True) == 0.0
        assert v.take_counts() == {"reward_errors": 1, "reward_timeouts": 0}
        assert v("fine", {}, finished=True) == 1.0
        assert v._worker.starts == 2
    finally:
        v.close()


def test_a_worker_that_cannot_start_stops_the_run():
    """No sample could be scored: that is the run's error, not a sample's."""
    v = Verifier(dying_verifier, timeout_s=10, isolate=True)
    v._worker = Worker(("megarl_no_such_module",))
    with pytest.raises(WorkerStartError, match="megarl_no_such_module"):
        v("x", {}, finished=True)


def test_a_non_finite_score_is_a_counted_error():
    """A NaN would stop the run at the non-finite check: it is one sample's error instead."""
    v = Verifier(nan_verifier, timeout_s=1, isolate=False)
    assert v("x", {}, finished=True) == 0.0
    assert v.take_counts() == {"reward_errors": 1, "reward_timeouts": 0}


def test_an_in_process_verifier_over_the_limit_scores_zero():
    v = Verifier(slow_verifier, timeout_s=0.1, isolate=False)
    assert v("x", {}, finished=True) == 0.0
    assert v.take_counts() == {"reward_errors": 0, "reward_timeouts": 1}


# ------------------------------------------------------------------------------ reward runner
def _runner(fn, *, batched=False, isolated=False, **kw) -> RewardRunner:
    return RewardRunner(VerifierEntry(fn, False, isolated, batched), name=getattr(fn, "__name__", "fn"),
                        **{"timeout_s": 30.0, **kw})


def _group(*texts) -> tuple:
    return list(texts), [{} for _ in texts], [True for _ in texts]


def test_batched_calls_take_whole_groups_up_to_the_batch_size_as_calls_free():
    """A batched verifier gets whole groups: the first at once (never held to fill a batch),
    the groups that finished while it ran together, up to reward.batch_size samples (a group
    that would pass it waits for the next call), the scores back to each group in order."""
    gate, calls = threading.Event(), []

    def lengths(response_texts, records, *, finished):
        calls.append(len(response_texts))
        gate.wait(30)
        return [float(len(t)) for t in response_texts]
    v = _runner(lengths, batched=True, concurrency=1, batch_size=4)
    try:
        first = v.submit(*_group("a", "bb"))
        while not calls:               # the first group is being scored alone
            time.sleep(0.001)
        later = [v.submit(*_group("c" * k, "d")) for k in (1, 2, 3)]
        while len(v._waiting) < 3:     # all three wait for the one call slot
            time.sleep(0.001)
        gate.set()
        assert first.result(30) == [1.0, 2.0]
        assert [f.result(30) for f in later] == [[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]]
        assert calls == [2, 4, 2]
    finally:
        gate.set()
        v.close()


def test_an_async_verifier_is_awaited_with_bounded_concurrency():
    """`async def` verifiers run on the runner's loop, at most reward.concurrency at once."""
    now, most = [0], [0]

    async def judge(response_text, record, *, finished):
        now[0] += 1
        most[0] = max(most[0], now[0])
        await asyncio.sleep(0.01)
        now[0] -= 1
        return 0.5 if finished else 0.25
    v = _runner(judge, concurrency=3)
    try:
        assert v.score_groups([_group(*"abcd"), _group(*"efgh")]) == [[0.5] * 4, [0.5] * 4]
        assert most[0] == 3 and v.calls == 8
        assert v("x", {}, finished=False) == 0.25
    finally:
        v.close()


def test_a_call_past_the_timeout_scores_its_samples_zero_without_waiting_for_it(caplog):
    """A plain function is left running in its thread; its batch scores 0 at the deadline, every
    sample counted, and one warning line says so; the runner goes on scoring."""
    gate = threading.Event()

    def stuck(response_texts, records, *, finished):
        if "hang" in response_texts:
            gate.wait(60)
        return [1.0] * len(response_texts)
    v = _runner(stuck, batched=True, concurrency=2, timeout_s=0.2)
    try:
        with caplog.at_level("WARNING", logger="megarl.rewards"):
            assert v.score_groups([_group("hang", "x", "y")]) == [[0.0, 0.0, 0.0]]
        assert not gate.is_set()       # the call still runs: the score did not wait for it
        assert v.take_counts() == {"reward_errors": 0, "reward_timeouts": 3}
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "reward.fn=stuck timed out on a batch of 3 samples, scored 0" in lines[0]
        assert v.score_groups([_group("ok")]) == [[1.0]]
    finally:
        gate.set()
        v.close()


@pytest.mark.parametrize("batched", [False, True])
def test_a_raising_verifier_of_either_kind_scores_zero_and_is_counted(batched):
    async def fails(*args, finished):
        raise RuntimeError("judge unreachable")
    v = _runner(fails, batched=batched)
    try:
        assert v.score_groups([_group("a", "b")]) == [[0.0, 0.0]]
        assert v.take_counts() == {"reward_errors": 2, "reward_timeouts": 0}
    finally:
        v.close()


def test_a_batched_verifier_returning_the_wrong_count_stops_the_run_in_one_line():
    """No score can be matched to its sample: the run stops with a line naming reward.fn."""
    v = _runner(lambda texts, records, *, finished: [1.0], batched=True)
    try:
        with pytest.raises(RewardOutputError) as e:
            v.score_groups([_group("a", "b")])
        assert str(e.value).startswith("reward.fn=<lambda>: a batched verifier returned 1 scores for a batch of 2 "
                                       "samples: return a list of one float per sample") and "\n" not in str(e.value)
    finally:
        v.close()
    v = _runner(lambda texts, records, *, finished: 1.0, batched=True)
    try:
        with pytest.raises(RewardOutputError, match="returned float 1.0 for a batch of 1"):
            v.score_groups([_group("a")])
    finally:
        v.close()


def test_non_float_scores_of_a_batch_are_counted_errors_in_one_line(caplog):
    """Each element that is not a finite number scores its sample 0 (counted); the others keep theirs."""
    v = _runner(lambda texts, records, *, finished: [1, "good", None, float("inf")], batched=True)
    try:
        with caplog.at_level("WARNING", logger="megarl.rewards"):
            assert v.score_groups([_group(*"abcd")]) == [[1.0, 0.0, 0.0, 0.0]]
        assert v.take_counts() == {"reward_errors": 3, "reward_timeouts": 0}
        first = caplog.records[0].getMessage()
        assert first.startswith("reward.fn=<lambda> returned no score on a sample, scored 0: 'good' is not a "
                                "finite number") and "\n" not in first
    finally:
        v.close()


# ------------------------------------------------------------------------------------- config
def test_registry_and_config_validation():
    assert {"countdown", "math", "exact", "format", "none"} <= set(VERIFIERS)
    # what each needs is a fact of its entry: the gold answer (math, exact), a killable worker (math)
    assert {n for n in VERIFIERS if needs_answer(n)} == {"math", "exact"}
    assert {n for n in VERIFIERS if verifier_entry(n).isolated} == {"math"}
    with pytest.raises(ConfigError) as e:
        RewardConfig(fn="maths")
    assert "reward.fn='maths'" in str(e.value)
    for name in ("countdown", "exact", "format", "math"):
        assert name in str(e.value)
    with pytest.raises(ConfigError, match="reward.timeout_s"):
        RewardConfig(fn="math", timeout_s=0)
    RewardConfig(fn="math", timeout_s=2.5)
