"""User code outside the repository trains, named by import path, with the run tracked in an
offline W&B run: a verifier (isolated: it runs in the verifier worker process, which loads the
same file) and an advantage estimator in one sync run; a batched verifier in a sync run, an
async one in a partial run; an environment in a partial run. Every run uses the session's
remote engine and the tiny countdown model (2 steps each)."""
import json

import pytest
from conftest import ROOT, run_py
from wandb_records import history, run_files

USER_CODE = '''
import asyncio
import os
import sys

from megarl.envs.base import Environment, StepResult
from megarl.ppo.advantages import Estimator, gae, token_rewards
from megarl.rewards import verifier

HERE = os.path.dirname(os.path.abspath(__file__))


def words_found(response_text, gold):
    """The share of the gold answer's words that the response holds."""
    gold_words = gold.split()
    return len(set(response_text.split()) & set(gold_words)) / len(gold_words)


@verifier(needs_answer=True, isolated=True)
def answer_words(response_text, record, *, finished, answer_key="answer"):
    with open(os.path.join(HERE, "verifier_calls.txt"), "a") as fh:
        fh.write(sys.argv[0] + "\\n")       # "-c" in the verifier worker process
    return words_found(response_text, record[answer_key])


@verifier(batched=True)
def batch_lengths(response_texts, records, *, finished):
    """A batched verifier: each call's size on a line, then one score per sample."""
    with open(os.path.join(HERE, "batch_calls.txt"), "a") as fh:
        fh.write(f"{len(response_texts)}\\n")
    return [min(len(t), 40) / 40 for t in response_texts]


async def judged_words(response_text, record, *, finished):
    """An async verifier, as a judge behind a network call would be."""
    await asyncio.sleep(0.01)
    with open(os.path.join(HERE, "async_calls.txt"), "a") as fh:
        fh.write("1\\n")
    return words_found(response_text, record["answer"])


def _gae_unwhitened(scores, kl, mask, values, algo, group_size):
    return gae(token_rewards(scores, mask, None, algo.kl_coef), values, mask, algo.gamma, algo.lam)


# GAE on the critic's values without whitening, as a user's own estimator
MY_GAE = Estimator(_gae_unwhitened, needs_critic=True)


class TwoTurns(Environment):
    """The first turn is answered with ' =', the second ends the episode: reward 1 when it
    holds a word of the record's answer."""

    async def reset(self, record):
        self.record, self.turns = record, 0
        return None

    async def step(self, turn):
        self.turns += 1
        with open(os.path.join(HERE, "env_steps.txt"), "a") as fh:
            fh.write(f"{self.turns}\\n")
        if self.turns < 2:
            return StepResult(observation=" =")
        return StepResult(reward=float(words_found(turn, self.record["answer"]) > 0), done=True)
'''


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("outside_the_repo") / "my_rl_code.py"
    path.write_text(USER_CODE)
    assert ROOT not in path.parents
    return path


def train(tiny_model, remote_engine, run_dir, *overrides):
    proc = run_py(["-m", "megarl.cli", "train", "recipes/tiny_cpu.yaml", f"model.path={tiny_model}",
                   f"data.prompts={tiny_model}/prompts.jsonl", f"run.dir={run_dir}", "train.steps=2",
                   "train.groups_per_step=4", "train.micro_batch_size=4", "rollout.sampling.n=2",
                   "rollout.dump_every=1", *remote_engine.overrides, *overrides], env=remote_engine.env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_verifier_and_estimator_from_a_file_train_and_wandb_logs_every_key(tiny_model, remote_engine, user_file,
                                                                           tmp_path):
    """reward.fn and algo.name name a file outside the repository: every sample's reward is the
    user's rule on its decoded response (recomputed here from the dumped samples), computed in
    the verifier's worker process, none failed. metrics.wandb in offline mode wrote a W&B run
    under run.dir whose history holds every key and value of metrics.jsonl."""
    from transformers import AutoTokenizer
    run_dir = tmp_path / "run"
    rows = train(tiny_model, remote_engine, run_dir, "rollout.mode=sync", f"reward.fn={user_file}:answer_words",
                 f"algo.name={user_file}:MY_GAE", "metrics.wandb.project=megarl-e2e", "metrics.wandb.mode=offline")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["reward_errors"] == 0 and r["reward_timeouts"] == 0 for r in rows)
    assert rows[-1]["value_loss"] > 0       # the estimator asked for a critic: it was built and trained

    tok = AutoTokenizer.from_pretrained(tiny_model)
    records = {json.loads(line)["prompt"]: json.loads(line)
               for line in (tiny_model / "prompts.jsonl").read_text().splitlines()}
    samples = [json.loads(line) for step in (0, 1)
               for line in (run_dir / "samples" / f"step_{step}.jsonl").read_text().splitlines()]
    for s in samples:
        text = tok.decode(s["response_ids"], skip_special_tokens=True)
        gold = records[tok.decode(s["prompt_ids"], skip_special_tokens=False)]["answer"].split()
        assert s["reward"] == pytest.approx(len(set(text.split()) & set(gold)) / len(gold))
    calls = (user_file.parent / "verifier_calls.txt").read_text().split()
    assert len(calls) == len(samples) and set(calls) == {"-c"}

    (wandb_run,) = run_files(run_dir)
    logged = history(wandb_run)
    assert [{k: r.get(k) for k in rows[0]} for r in logged] == rows


def _dumped(run_dir, steps=(0, 1)) -> list[dict]:
    return [json.loads(line) for step in steps
            for line in (run_dir / "samples" / f"step_{step}.jsonl").read_text().splitlines()]


def test_a_batched_verifier_trains_a_sync_run_with_whole_groups(tiny_model, remote_engine, user_file, tmp_path):
    """reward.fn names a batched verifier (@verifier(batched=True)) and reward.batch_size=4: the
    run trains, each call held whole groups (rollout.sampling.n=2) of at most 4 samples, every
    trained sample was scored by it (its reward is the rule's), none failed."""
    from transformers import AutoTokenizer
    run_dir = tmp_path / "batched"
    rows = train(tiny_model, remote_engine, run_dir, "rollout.mode=sync", f"reward.fn={user_file}:batch_lengths",
                 "reward.batch_size=4")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["reward_errors"] == 0 and r["reward_timeouts"] == 0 for r in rows)
    sizes = [int(n) for n in (user_file.parent / "batch_calls.txt").read_text().split()]
    samples = _dumped(run_dir)
    assert sum(sizes) == len(samples) == 16 and all(n in (2, 4) for n in sizes), sizes
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for s in samples:
        assert s["reward"] == pytest.approx(min(len(tok.decode(s["response_ids"], skip_special_tokens=True)), 40) / 40)


def test_an_async_verifier_trains_a_partial_run(tiny_model, remote_engine, user_file, tmp_path):
    """reward.fn names an `async def`: the partial rollout awaits it off the engines' loop (the
    reward runner's), every trained sample scored by it, none failed."""
    run_dir = tmp_path / "async"
    rows = train(tiny_model, remote_engine, run_dir, "rollout.mode=partial", f"reward.fn={user_file}:judged_words",
                 "reward.concurrency=8")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["reward_errors"] == 0 and r["reward_timeouts"] == 0 for r in rows)
    calls = (user_file.parent / "async_calls.txt").read_text().split()
    samples = _dumped(run_dir)
    # elastic steps (rollout.partial.max_step_multiple) may train whole multiples of the 4 groups;
    # groups scored beyond the steps' are carried, so the calls may outnumber the samples
    assert len(samples) == sum(r["samples"] for r in rows) > 0 and len(samples) % 8 == 0
    assert len(calls) >= len(samples)
    assert all(0.0 <= s["reward"] <= 1.0 for s in samples)


def test_environment_from_a_file_runs_episodes(tiny_model, remote_engine, user_file, tmp_path):
    """env.name names a class in a file outside the repository: its episodes run in the
    environment loop (two model turns each unless the budget cuts one), its observation tokens
    are masked out, its reward is the score, and no call failed."""
    run_dir = tmp_path / "episodes"
    rows = train(tiny_model, remote_engine, run_dir, f"env.name={user_file}:TwoTurns", "env.max_turns=2")
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["env_errors"] == 0 and r["env_timeouts"] == 0, r
        assert r["episode_turns_mean"] > 1 and r["observation_tokens_mean"] > 0, r
    steps = (user_file.parent / "env_steps.txt").read_text().split()
    assert {"1", "2"} <= set(steps)
    samples = [json.loads(line) for line in (run_dir / "samples" / "step_1.jsonl").read_text().splitlines()]
    assert all(s["reward"] in (0.0, 1.0) and s["mask"][-1] == 1 for s in samples)
    assert any(0 in s["mask"] for s in samples)
