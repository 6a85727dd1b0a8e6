"""`python_tool`: math problems with a Python interpreter as a tool (docs/agents.md).

A model turn that holds a code block (```python ... ``` or <python>...</python>) is a tool call:
the LAST block runs in the sandbox (megarl.envs.sandbox) and the observation is its output
("output:\\n..."), the last line of its error, or "timeout". A turn without a code block is the
final answer: the episode ends and its reward is the `math` verifier's score of that turn
against record["answer"] (megarl.rewards.math, run in a worker process that can be killed,
as reward.fn=math runs). An episode cut by env.max_turns while still calling the tool scores 0.

Options (env.options): cpu_s, wall_s, memory_mb, output_bytes (SandboxLimits), score_timeout_s
(the verifier's limit) and allow_weak_sandbox (run on a machine whose kernel layers miss one of
the sandbox's guarantees instead of refusing: only inside a container of your own).
env.timeout_s must exceed wall_s plus the sandbox start-up.
"""
from __future__ import annotations

import asyncio
import re
import threading
from typing import Optional

from megarl.envs.base import Environment, StepResult, register_env
from megarl.envs.sandbox import SandboxLimits, SandboxResult, SandboxUnavailable, require, run_python

# an unclosed block at the very end counts: a stop string such as "```" may have cut its fence
_FENCED = re.compile(r"```(?:python|py)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_TAGGED = re.compile(r"<python>(.*?)(?:</python>|\Z)", re.DOTALL)

#: how the observation says the run ran out of time
TIMEOUT_OBSERVATION = "timeout"


def last_code_block(turn: str) -> Optional[str]:
    """The code of the turn's last ```python block or <python> tag (whichever starts later),
    or None when the turn has none (it is then the final answer)."""
    found = [(m.start(), m.group(1)) for pattern in (_FENCED, _TAGGED) for m in pattern.finditer(turn)]
    return max(found)[1] if found else None


def observation(result: SandboxResult) -> str:
    """What the model sees of one run: its output, its error's last line, or "timeout"."""
    if result.timed_out:
        return TIMEOUT_OBSERVATION
    if result.exit_code != 0 and not result.truncated:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        return lines[-1].strip() if lines else f"error: exit code {result.exit_code}"
    text = result.stdout if result.stdout.strip() else "(no output)"
    if result.truncated:
        text = text.rstrip("\n") + "\n... (output truncated)"
    return "output:\n" + text


_verifier = None
_verifier_lock = threading.Lock()


def _math_verifier(timeout_s: float):
    """One `math` verifier for every episode of the process: its worker pays the sympy import
    once, and its lock lets one score run at a time (scores take milliseconds)."""
    global _verifier
    with _verifier_lock:
        if _verifier is None:
            from megarl.rewards.math import math_score
            from megarl.rewards.verify import Verifier
            _verifier = Verifier(math_score, timeout_s=timeout_s, isolate=True, name="math")
        return _verifier


@register_env("python_tool")
class PythonToolEnv(Environment):
    """Math problems with a sandboxed Python tool; the final answer is scored by `math`."""

    def __init__(self, seed: int = 0, cpu_s: float = 3.0, wall_s: float = 5.0, memory_mb: int = 512,
                 output_bytes: int = 2048, score_timeout_s: float = 10.0, allow_weak_sandbox: bool = False,
                 **options):
        super().__init__(seed, **options)
        if options:
            raise ValueError(f"env.options {sorted(options)} unknown to env.name=python_tool: it takes "
                             "cpu_s, wall_s, memory_mb, output_bytes, score_timeout_s, allow_weak_sandbox")
        if not score_timeout_s > 0:
            raise ValueError(f"env.options.score_timeout_s={score_timeout_s!r} must be > 0 seconds")
        if not isinstance(allow_weak_sandbox, bool):
            raise ValueError(f"env.options.allow_weak_sandbox={allow_weak_sandbox!r} must be true or false")
        try:   # refused here, when the run's preflight makes one, not at the first tool call
            require(allow_weak_sandbox)
        except SandboxUnavailable as err:
            raise ValueError(str(err)) from None
        self.allow_weak_sandbox = allow_weak_sandbox
        self.limits = SandboxLimits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb, output_bytes=output_bytes)
        self.score_timeout_s = score_timeout_s
        self.record: dict = {}

    async def reset(self, record: dict) -> Optional[str]:
        if "answer" not in record:
            raise KeyError("env.name=python_tool needs an 'answer' in every record (the math verifier's gold)")
        self.record = record
        return None

    async def step(self, turn: str) -> StepResult:
        code = last_code_block(turn)
        if code is None:
            verifier = _math_verifier(self.score_timeout_s)
            # the worker call blocks: off the environment loop, so other episodes go on
            reward = await asyncio.to_thread(verifier, turn, self.record, finished=True)
            return StepResult(reward=reward, done=True, info={"tool_calls": 0})
        result = await run_python(code, self.limits, self.allow_weak_sandbox)
        return StepResult(observation=observation(result), done=False,
                          info={"tool_calls": 1, "tool_timeouts": int(result.timed_out),
                                "tool_errors": int(not result.ok and not result.timed_out)})
