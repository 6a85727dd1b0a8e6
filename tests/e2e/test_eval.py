"""Held-out evaluation (eval.*) end to end: `megarl train` on the tiny model with a held-out
file whose prompts the training data does not hold, on the shared vLLM server
(`remote_engine`). One sync run with evaluation, the same run without it, and one async
partial run with evaluation beside its prefetched rounds; `megarl eval` of the sync run's
checkpoint and export against its in-run evaluations."""
import itertools
import json

import pytest
from conftest import ROOT, run_py

HELDOUT = ROOT / "tests" / "data" / "countdown_heldout.jsonl"
STEPS, EVERY, N, KS = 4, 2, 4, (1, 2, 4)
SYNC = ("rollout.mode=sync", f"train.steps={STEPS}", "train.groups_per_step=8", "rollout.dump_every=1",
        "metrics.tensorboard=false")
EVAL = (f"eval.datasets=[{HELDOUT}]", f"eval.every={EVERY}", f"eval.n={N}", "eval.temperature=1.0",
        f"eval.k=[{','.join(map(str, KS))}]")


def _train(tiny_model, remote_engine, run_dir, prompts, *overrides):
    proc = run_py(["-m", "megarl.cli", "train", "recipes/tiny_cpu.yaml", f"model.path={tiny_model}",
                   f"data.prompts={prompts}", f"run.dir={run_dir}", *remote_engine.overrides, *overrides],
                  env=remote_engine.env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return proc, rows


@pytest.fixture(scope="module")
def training_prompts(tiny_model, tmp_path_factory):
    """The tiny model's prompts without those of the held-out file."""
    held = {json.loads(line)["prompt"] for line in HELDOUT.read_text().splitlines()}
    rows = [line for line in (tiny_model / "prompts.jsonl").read_text().splitlines()
            if line.strip() and json.loads(line)["prompt"] not in held]
    path = tmp_path_factory.mktemp("eval_data") / "train.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def sync_runs(tiny_model, remote_engine, training_prompts, tmp_path_factory):
    base = tmp_path_factory.mktemp("eval_runs")
    # checkpoints step_1 and step_3 (versions 2 and 4, both evaluated in the run) and the final export
    on = _train(tiny_model, remote_engine, base / "on", training_prompts, *SYNC, *EVAL, "checkpoint.every=2",
                "checkpoint.hf_final=true")
    off = _train(tiny_model, remote_engine, base / "off", training_prompts, *SYNC)
    return base, on, off


def _eval_rows(rows):
    return [r for r in rows if any(k.startswith("eval/") for k in r)]


def test_eval_rows_at_start_every_and_end_with_one_console_line_each(sync_runs):
    base, (proc, rows), _ = sync_runs
    evals = _eval_rows(rows)
    assert [r["step"] for r in evals] == [0, 2, 4]
    # the engines held the version each row is logged at
    assert [r["eval/weight_version"] for r in evals] == [0, 2, 4]
    assert [r["step"] for r in rows if "reward_mean" in r] == list(range(STEPS))
    prefix = "eval/countdown_heldout/"
    for r in evals:
        keys = {f"mean@{N}", f"maj@{N}", *(f"pass@{k}" for k in KS), "response_len_mean", "prompts"}
        assert {prefix + k for k in keys} <= set(r), sorted(r)
        assert r[prefix + "prompts"] == len(HELDOUT.read_text().splitlines())
    out = proc.stdout + proc.stderr
    assert sum(f"eval {v:4d} | countdown_heldout mean@{N}=" in out for v in (0, 2, 4)) == 3


def _choose_share(correct, k):
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_logged_figures_match_a_direct_computation_from_the_dumped_samples(sync_runs):
    """pass@k as the share of k-subsets of each prompt's samples holding a correct one, mean@n
    and maj@n recomputed from the dump's rewards and answers, against the logged row."""
    base, (_, rows), _ = sync_runs
    prefix = "eval/countdown_heldout/"
    nontrivial = False
    for row in _eval_rows(rows):
        dumped = [json.loads(x) for x in (base / "on" / "eval" / "countdown_heldout" /
                                          f"step_{row['step']}.jsonl").read_text().splitlines()]
        prompts = sorted({d["prompt_index"] for d in dumped})
        assert len(dumped) == N * len(prompts)
        by_prompt = [[d for d in dumped if d["prompt_index"] == p] for p in prompts]
        for k in KS:
            want = sum(_choose_share([d["reward"] >= 1.0 for d in g], k) for g in by_prompt) / len(by_prompt)
            assert row[prefix + f"pass@{k}"] == pytest.approx(want, abs=1e-12), (row["step"], k)
        mean = sum(d["reward"] for d in dumped) / len(dumped)
        assert row[prefix + f"mean@{N}"] == pytest.approx(mean, abs=1e-12)
        votes = []
        for g in by_prompt:
            stated = [d["answer"] for d in g if d["answer"] is not None]
            top = max(stated, key=lambda a: (stated.count(a), -stated.index(a))) if stated else None
            votes.append(next((d["reward"] >= 1.0 for d in g if d["answer"] == top), False) if top else False)
        assert row[prefix + f"maj@{N}"] == pytest.approx(sum(votes) / len(votes), abs=1e-12)
        nontrivial |= 0.0 < row[prefix + "pass@1"] < row[prefix + f"pass@{N}"]
    assert nontrivial, "every evaluation was all right or all wrong: the comparison above proves little"


def test_a_sync_run_trains_the_same_samples_with_evaluation_on_and_off(sync_runs):
    base, (_, on_rows), (_, off_rows) = sync_runs
    assert not _eval_rows(off_rows) and not (base / "off" / "eval").exists()
    for step in range(STEPS):
        on = (base / "on" / "samples" / f"step_{step}.jsonl").read_text().splitlines()
        off = (base / "off" / "samples" / f"step_{step}.jsonl").read_text().splitlines()
        assert on == off, f"step {step}: the trained samples differ with evaluation on"
    trained_on = [r for r in on_rows if "reward_mean" in r]
    trained_off = [r for r in off_rows if "reward_mean" in r]
    assert [r["policy_loss"] for r in trained_on] == [r["policy_loss"] for r in trained_off]


def _eval_cli(training_prompts, out, *args):
    """`megarl eval` on a local server of its own: the shared remote server holds the weights some
    run pushed last, not the model scored (evaluate.input_problem refuses remote engines)."""
    proc = run_py(["-m", "megarl.cli", "eval", "recipes/tiny_cpu.yaml", *map(str, args), "--out", str(out),
                   f"data.prompts={training_prompts}", "rollout.engines.mode=local_servers",
                   "metrics.tensorboard=false", *EVAL])
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _scored(row):
    return {k: v for k, v in row.items() if k.startswith("eval/") and k not in ("eval/time_s", "eval/weight_version")}


def test_megarl_eval_of_the_checkpoint_and_the_export_equals_the_in_run_evaluation(sync_runs, training_prompts,
                                                                                  tmp_path):
    """Slow (two engine starts): `megarl eval --run` of checkpoint step_1 is version 2, `--model`
    of the final export (hf/final) version 0 with the final weights: each row and dump (tokens,
    logprobs, rewards, answers) equals the run's own evaluation of those weights (the same seeds,
    eval.temperature=1.0)."""
    base, (_, rows), _ = sync_runs
    in_run = {r["step"]: r for r in _eval_rows(rows)}
    dumps = base / "on" / "eval" / "countdown_heldout"
    cases = ((("--run", base / "on", "--step", 1), 2, 2), (("--model", base / "on" / "hf" / "final"), 0, 4))
    for i, (args, version, step) in enumerate(cases):
        out = tmp_path / f"eval{i}"
        (row,) = _eval_cli(training_prompts, out, *args)
        assert row["step"] == version and row["eval/weight_version"] == version
        assert _scored(row) == _scored(in_run[step]), (args, _scored(row), _scored(in_run[step]))
        mine = [json.loads(x) for x in (out / "eval" / "countdown_heldout" / f"step_{version}.jsonl").open()]
        theirs = [json.loads(x) for x in (dumps / f"step_{step}.jsonl").open()]
        assert {v for d in mine for v in d.pop("versions")} == {version}   # the engines' tokens say so
        assert mine == [{k: v for k, v in d.items() if k != "versions"} for d in theirs], args
    # the two versions' dumps differ (their logprobs at least): equal dumps tell the weights apart
    assert (dumps / "step_2.jsonl").read_text() != (dumps / "step_4.jsonl").read_text()


def test_async_partial_rounds_run_beside_the_evaluation(tiny_model, remote_engine, training_prompts, tmp_path):
    """rollout.partial.async in keep mode (the defaults): the evaluation at each step runs while
    the prefetched round generates on the same engine (which ends only when its step asks for
    it, so it never holds the evaluation's requests); each evaluation sees the step's weights
    and every round still trains its groups."""
    _, rows = _train(tiny_model, remote_engine, tmp_path / "async", training_prompts, "train.steps=2",
                     "train.groups_per_step=8", "rollout.partial.async=true",
                     f"eval.datasets=[{HELDOUT}]", "eval.every=1", "metrics.tensorboard=false")
    evals = _eval_rows(rows)
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert [r["eval/weight_version"] for r in evals] == [0, 1, 2]
    trained = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in trained] == [0, 1] and all(r["samples"] > 0 for r in trained)
    # the controller's book counts its own requests only: its in-flight mean stays within its bound
    assert all(r["rollout_inflight_mean"] <= r["rollout_concurrency"] for r in trained), trained
