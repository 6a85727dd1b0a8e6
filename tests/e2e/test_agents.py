"""Multi-turn agent episodes end to end on CPU: real megatron-core trainer, real vLLM engine,
the tiny "guess the number" model (tools/make_tiny_agent_model.py).

Two runs share this file's model build: the environment run (env.name=guess in the
partial-rollout controller) and the service run (rollout.mode=service: an outside agent
drives the policy with the `openai` client). Each starts one engine of its own.
"""
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, run_py

AGENT_MODEL = ROOT / "artifacts" / "tiny_guess"


@pytest.fixture(scope="module")
def agent_model():
    """The tiny guess-the-number model (idempotent: a no-op when built; locked like tiny_model)."""
    from filelock import FileLock
    with FileLock(str(AGENT_MODEL) + ".lock"):
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_agent_model.py"), "--out", str(AGENT_MODEL)],
                       check=True, cwd=ROOT)
    return AGENT_MODEL


def read_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_episodes_train_token_exact_with_observations_masked(agent_model, tmp_path):
    """Two steps of the agent recipe: every sample is an episode of >= 1 model turns whose
    observation tokens are the task's answer words and carry mask 0 and logprob 0; the
    engine's behaviour logprobs of the model tokens equal the trainer's on the trained sequence
    (so the trainer's ids are what the engine conditioned on: a lost boundary token would move
    every later logprob), also after the weight push (weight_sync.verify); no environment error."""
    from transformers import AutoTokenizer
    run_dir = tmp_path / "agent"
    proc = run_py(["-m", "megarl.cli", "train", "recipes/tiny_agent_cpu.yaml", f"model.path={agent_model}",
                   f"data.prompts={agent_model}/prompts.jsonl", f"run.dir={run_dir}", "train.steps=2",
                   "train.groups_per_step=8", "train.micro_batch_size=8", "rollout.dump_every=1",
                   "weight_sync.verify=true", "checkpoint.every=1"])
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["episode_turns_mean"] >= 1 and r["observation_tokens_mean"] > 0, r
        assert r["env_errors"] == 0 and r["env_timeouts"] == 0
        assert r["logprob_mismatch_mean"] < 1e-3, r["logprob_mismatch_mean"]
        assert r["sync_verify_gap"] < 1e-3
    tok = AutoTokenizer.from_pretrained(agent_model)
    answers = {tok.convert_tokens_to_ids(w) for w in ("higher", "lower", "invalid")}
    samples = [json.loads(line) for line in (run_dir / "samples" / "step_1.jsonl").read_text().splitlines()]
    multi = 0
    for s in samples:
        mask, ids = s["mask"], s["response_ids"]
        assert len(mask) == len(ids) == len(s["logprobs"]) and mask[-1] == 1
        obs = [t for t, m in zip(ids, mask) if not m]
        assert all(lp == 0.0 for lp, m in zip(s["logprobs"], mask) if not m)
        assert not answers & {t for t, m in zip(ids, mask) if m}, "an answer word was marked as the model's"
        assert len([t for t in obs if t in answers]) == s["turns"] - 1 or s["finish_reason"] == "length"
        multi += s["turns"] > 1
        assert s["reward"] in (0.0, 1.0)
    assert multi > 0, "some episode must have more than one turn"


@pytest.fixture(scope="module")
def service_run(agent_model, tmp_path_factory):
    """A two-step service run; the test's thread is the outside agent (examples/guess_agent.py)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import guess_agent
    run_dir = tmp_path_factory.mktemp("service") / "run"
    steps, groups, n = 2, 4, 4
    proc = subprocess.Popen([sys.executable, "-m", "megarl.cli", "train", "recipes/tiny_agent_service_cpu.yaml",
                             f"model.path={agent_model}", f"data.prompts={agent_model}/prompts.jsonl",
                             f"run.dir={run_dir}", f"train.steps={steps}", f"train.groups_per_step={groups}",
                             "train.micro_batch_size=8"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    out = {}
    try:
        service = guess_agent.connect(str(run_dir / "service.json"), wait_s=600)
        out["service"] = service
        out["probe"] = probe_service(service)
        played = guess_agent.run(service, steps * groups * n, workers=8)
        out["played"] = played
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return run_dir, proc.returncode, stderr, out


def probe_service(service):
    """While the run waits for its first groups: a wrong key is refused; one episode played by
    hand, its recorded tokens compared with what the client was told (then cancelled)."""
    import httpx
    import openai
    bad = openai.OpenAI(base_url=service["base_url"], api_key="not-the-key", max_retries=0)
    refused = False
    try:
        bad.models.list()
    except openai.AuthenticationError:
        refused = True
    good = openai.OpenAI(base_url=service["base_url"], api_key=service["api_key"], max_retries=0)
    headers = {"Authorization": f"Bearer {service['api_key']}"}
    with httpx.Client(base_url=service["url"], headers=headers, timeout=600) as http:
        ep = http.post("/v1/episodes").raise_for_status().json()
        messages = list(ep["task"]["messages"])
        replies = []
        for answer in ("higher", "lower"):
            r = good.chat.completions.create(model=service["model"], messages=messages, logprobs=True,
                                             extra_body={"episode_id": ep["episode_id"]})
            replies.append([t.logprob for t in r.choices[0].logprobs.content])
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": answer}]
        recorded = http.get(f"/v1/episodes/{ep['episode_id']}").raise_for_status().json()
        http.post(f"/v1/episodes/{ep['episode_id']}/cancel").raise_for_status()
    return {"refused": refused, "replies": replies, "recorded": recorded}


def test_outside_agent_trains_through_the_openai_endpoint(service_run):
    """The agent's episodes (openai client, 4 groups x 4 episodes per step) feed both steps;
    the run ends cleanly; rewards and turns come from the agent's reports."""
    run_dir, code, stderr, out = service_run
    assert code == 0, stderr[-6000:]
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    played = out["played"]
    assert len(played) == 32
    assert all(r["agent_episodes_finished"] >= 16 for r in rows)
    trained_mean = sum(r["reward_mean"] for r in rows) / 2
    played_mean = sum(p["reward"] for p in played) / len(played)
    assert abs(trained_mean - played_mean) < 1e-6, (trained_mean, played_mean)
    assert (os.stat(run_dir / "service.json").st_mode & 0o077) == 0, "the key file must be owner-only"


def test_service_refuses_a_wrong_key_and_records_what_the_engine_produced(service_run):
    """A wrong API key gets 401 (openai.AuthenticationError); the recorded trajectory's model
    tokens carry exactly the logprobs the client received, in order, and the observation tokens
    between them are mask 0."""
    _, _, _, out = service_run
    probe = out["probe"]
    assert probe["refused"]
    rec = probe["recorded"]
    model_lp = [lp for lp, m in zip(rec["logprobs"], rec["mask"]) if m]
    assert model_lp == pytest.approx([lp for reply in probe["replies"] for lp in reply], abs=1e-6)
    assert 0 in rec["mask"] and rec["mask"][0] == 1
