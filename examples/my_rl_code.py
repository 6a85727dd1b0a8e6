"""A verifier and an environment of your own, outside megarl: name them by import path.

    megarl train recipes/tiny_cpu.yaml reward.fn=examples/my_rl_code.py:short_score
    megarl train recipes/tiny_cpu.yaml reward.fn=examples/my_rl_code.py:short_scores reward.batch_size=16
    megarl train recipes/tiny_cpu.yaml reward.fn=examples/my_rl_code.py:judged_length
    megarl train recipes/tiny_agent_cpu.yaml env.name=examples/my_rl_code.py:KeywordEnv

(or `reward.fn=my_package.my_rl_code:short_score` once the module is importable: installed, or
its folder on PYTHONPATH). docs/data.md ("Your own verifier") and docs/agents.md ("Writing an
environment") explain each part.
"""
import asyncio

from megarl.envs.base import Environment, StepResult
from megarl.rewards import verifier


@verifier(needs_answer=False, isolated=False)
def short_score(response_text: str, record: dict, *, finished: bool) -> float:
    """1 for a response that ended on its own (eos) within 200 characters, else 0."""
    return 1.0 if finished and len(response_text) < 200 else 0.0


class KeywordEnv(Environment):
    """The model must say record["keyword"]: reward 1 when a turn is exactly it; otherwise the
    observation says how many letters were right. Options: none."""

    async def reset(self, record: dict):
        self.keyword = record["keyword"]     # a KeyError ends the episode with reward 0, counted
        return None                          # the prompt (data.prompts) says it all

    async def step(self, turn: str) -> StepResult:
        guess = turn.strip()
        if guess == self.keyword:
            return StepResult(reward=1.0, done=True)
        right = sum(a == b for a, b in zip(guess, self.keyword))
        return StepResult(observation=f"{right} letters right")


@verifier(batched=True)
def short_scores(response_texts: list[str], records: list[dict], *, finished: list[bool]) -> list[float]:
    """short_score over a batch (whole groups, up to reward.batch_size samples): one float per sample."""
    return [1.0 if done and len(text) < 200 else 0.0 for text, done in zip(response_texts, finished)]


async def judged_length(response_text: str, record: dict, *, finished: bool) -> float:
    """An async verifier (awaited off the engines' loop, reward.concurrency at once): where a call
    to a judge over the network would go; here the response's length, scaled to [0, 1]."""
    await asyncio.sleep(0)
    return min(len(response_text), 200) / 200
