"""`python_tool` (megarl/envs/tool_math.py): code turns run in the sandbox and come back as
observations; the turn without code is the final answer, scored by the math verifier. The
episode runs on an EnvRunner, as in training (the environment loop is a thread of its own).
The first scored turn starts the verifier's worker process (a few seconds: sympy)."""
from __future__ import annotations

import pytest

from megarl.envs.base import env_spec
from megarl.envs.runner import EnvRunner
from megarl.envs.sandbox import SandboxResult, available_layers, refusal
from megarl.envs.tool_math import PythonToolEnv, last_code_block, observation

# these tests are about the environment, not the sandbox (tests/unit/test_sandbox_escapes.py):
# on a machine whose kernel lacks a layer the environment would refuse to run, so accept it here
WEAK = {"allow_weak_sandbox": True} if refusal(available_layers()) else {}

RECORD = {"prompt": "What is 17 * 23 - 1?", "answer": "390"}


@pytest.fixture(scope="module")
def runner():
    r = EnvRunner("test-tool-env")
    yield r
    r.close()


def _episode(runner, turns, record=RECORD, **options):
    env = PythonToolEnv(seed=0, **WEAK, **options)
    results = []
    try:
        assert runner.run(env.reset(record), 30) is None
        for turn in turns:
            results.append(runner.run(env.step(turn), 30))
    finally:
        runner.run(env.close(), 30)
    return results


def test_last_code_block():
    two = "first\n```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```\ndone"
    assert last_code_block(two) == "print(2)\n"
    assert last_code_block("<python>print(3)</python> and ```python\nprint(4)\n```") == "print(4)\n"
    assert last_code_block("```python\nprint(5)\n``` then <python>print(6)</python>") == "print(6)"
    assert last_code_block("cut at the stop string:\n```python\nprint(7)\n") == "print(7)\n"
    assert last_code_block("so the answer is \\boxed{390}") is None
    assert last_code_block("```\nnot tagged python\n```") is None


def test_observation_forms():
    assert observation(SandboxResult("5\n", "", 0)) == "output:\n5\n"
    assert observation(SandboxResult("", "", 0)) == "output:\n(no output)"
    assert observation(SandboxResult("x", "", -9, timed_out=True, killed=True)) == "timeout"
    err = 'Traceback (most recent call last):\n  File "main.py", line 1\nZeroDivisionError: division by zero\n'
    assert observation(SandboxResult("partial\n", err, 1)) == "ZeroDivisionError: division by zero"
    assert observation(SandboxResult("yyyy", "", -9, killed=True, truncated=True)) == \
        "output:\nyyyy\n... (output truncated)"
    assert observation(SandboxResult("", "", -11, killed=True)) == "error: exit code -11"


def test_episode_code_then_final_answer_scores_one(runner):
    code_turn = "Let me compute.\n```python\nprint(17 * 23 - 1)\n```"
    tool, final = _episode(runner, [code_turn, "The result is \\boxed{390}."])
    assert (tool.observation, tool.done, tool.reward) == ("output:\n390\n", False, 0.0)
    assert tool.info["tool_calls"] == 1 and tool.info["tool_timeouts"] == 0
    assert (final.done, final.reward) == (True, 1.0)


def test_wrong_final_answer_scores_zero(runner):
    (final,) = _episode(runner, ["I think it is \\boxed{391}."])
    assert (final.done, final.reward) == (True, 0.0)


def test_error_and_timeout_turns(runner):
    err, slow = _episode(runner, ["<python>print(1/0)</python>", "```python\nwhile True:\n    pass\n```"],
                         cpu_s=1, wall_s=30)   # the loop ends at its CPU second; 1/0 never waits
    assert (err.observation, err.done) == ("ZeroDivisionError: division by zero", False)
    assert err.info["tool_errors"] == 1
    assert (slow.observation, slow.done, slow.reward) == ("timeout", False, 0.0)
    assert slow.info["tool_timeouts"] == 1


def test_registered_as_python_tool():
    assert env_spec("python_tool").factory is PythonToolEnv


def test_options_are_checked():
    env = PythonToolEnv(seed=1, cpu_s=2, wall_s=3, memory_mb=256, output_bytes=100, **WEAK)
    assert (env.limits.cpu_s, env.limits.wall_s, env.limits.memory_mb, env.limits.output_bytes) == (2, 3, 256, 100)
    with pytest.raises(ValueError, match="unknown to env.name=python_tool"):
        PythonToolEnv(seed=0, wall_clock=3, **WEAK)
    with pytest.raises(ValueError, match="memory_mb=1"):
        PythonToolEnv(seed=0, memory_mb=1, **WEAK)
