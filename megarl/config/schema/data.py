"""Prompts and how samples are scored."""
from __future__ import annotations

from dataclasses import dataclass

from megarl.config.registry import VERIFIERS
from megarl.config.schema.checks import require


@dataclass
class DataConfig:
    # .jsonl or .parquet file, one record per row (docs/data.md)
    prompts: str = "artifacts/tiny_countdown/prompts.jsonl"
    prompt_key: str = "prompt"         # field of each record holding the prompt text
    # or: the field holding chat messages [{role, content}], rendered with the tokenizer's chat template
    messages_key: str = "messages"
    answer_key: str = "answer"         # field holding the gold answer (reward.fn=math | exact need it)
    shuffle: bool = True               # reshuffle each epoch (seeded by run.seed)

    def __post_init__(self):
        for key in ("prompt_key", "messages_key", "answer_key"):
            require(bool(str(getattr(self, key)).strip()), f"data.{key}", getattr(self, key),
                     "must name a field of the data rows")


@dataclass
class RewardConfig:
    fn: str = "countdown"              # verifier: countdown | math | exact | format | none (no verifier; docs/data.md)
    model_path: str = ""               # HF *ForSequenceClassification reward model, scored on the trainer ranks
    model_coef: float = 1.0            # score = verifier + model_coef * reward model
    # a verifier taking longer than this on one sample scores it 0 (counted: reward_timeouts)
    timeout_s: float = 5.0
    # DAPO's soft overlong punishment (docs/algorithms.md), on the trainer, every rollout mode: a
    # response longer than rollout.sampling.max_new_tokens - overlong_buffer tokens loses up to
    # overlong_penalty, linearly, reached at the budget; 0: off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self):
        VERIFIERS.check(self.fn)
        require(self.overlong_buffer >= 0, "reward.overlong_buffer", self.overlong_buffer,
                 "must be >= 0 (tokens before rollout.sampling.max_new_tokens; 0: off)")
        require(self.overlong_penalty >= 0, "reward.overlong_penalty", self.overlong_penalty,
                 "must be >= 0 (the largest penalty, subtracted from the score)")
        require(self.timeout_s > 0, "reward.timeout_s", self.timeout_s, "must be > 0 (seconds per sample)")
        require(self.fn != "none" or bool(self.model_path), "reward.fn", self.fn,
                 "with reward.fn=none set reward.model_path, or nothing scores the samples")
        require(bool(self.model_path) or self.model_coef == 1.0, "reward.model_coef", self.model_coef,
                 "weighs the reward model, but reward.model_path is empty: set reward.model_path, "
                 "or remove reward.model_coef")
