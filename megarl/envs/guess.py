"""The "guess the number" environment (megarl/data/guess.py has the task and its tokenizer).

Each model turn must be exactly one number word in 1..K ("n5"); the answer is "higher" (the
secret is larger), "lower", or the episode ends on the secret with reward 1. Anything else
(no word, two words, a number out of range, another word) is answered "invalid" and still uses
a turn. The turn limit is the runner's (`env.max_turns`): an episode it cuts scores 0.

Pure and deterministic: the answers depend only on the record (secret, k) and the turn, so a
resumed run replays an episode exactly.
"""
from __future__ import annotations

from megarl.data import guess as task
from megarl.envs.base import Environment, StepResult, register_env


def record_task(record: dict) -> tuple[int, int]:
    """(secret, k) of a record; ValueError naming the field when it is missing or out of range."""
    k = record.get("k", task.DEFAULT_K)
    secret = record.get("secret")
    if not isinstance(k, int) or not 2 <= k <= task.MAX_K:
        raise ValueError(f"guess record field 'k'={k!r}: use an integer in 2..{task.MAX_K} "
                         f"(megarl.data.guess.make_records writes it)")
    if not isinstance(secret, int) or not 1 <= secret <= k:
        raise ValueError(f"guess record field 'secret'={secret!r}: use an integer in 1..{k} "
                         f"(megarl.data.guess.make_records writes it)")
    return secret, k


def answer(turn: str, secret: int, k: int) -> StepResult:
    """The environment's answer to one model turn (its text decoded without special tokens)."""
    words = turn.split()
    guess = task.parse_number(words[0]) if len(words) == 1 else None
    if guess is None or not 1 <= guess <= k:
        return StepResult(observation=task.INVALID, info={"invalid": 1})
    if guess == secret:
        return StepResult(observation=task.CORRECT, reward=1.0, done=True, info={"solved": 1})
    return StepResult(observation=task.HIGHER if secret > guess else task.LOWER)


@register_env("guess")
class GuessEnv(Environment):
    """Guess the record's secret in 1..k: each turn one number word, answered higher / lower /
    invalid; the secret ends the episode with reward 1. No options."""

    def __init__(self, seed: int = 0, **options):
        if options:
            raise ValueError(f"env.options={options!r}: the guess environment takes no options; "
                             f"remove env.options (k and the secret come from each record)")
        super().__init__(seed)
        self.secret, self.k = 0, task.DEFAULT_K

    async def reset(self, record: dict):
        self.secret, self.k = record_task(record)
        return None   # the prompt ("guess n1 n8") says it all

    async def step(self, turn: str) -> StepResult:
        if not self.secret:
            raise RuntimeError("guess environment: step() before reset(record)")
        return answer(turn, self.secret, self.k)
