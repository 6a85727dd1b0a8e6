"""Prompts and how samples are scored."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from megarl.config.errors import ConfigError
from megarl.config.registry import VERIFIERS
from megarl.config.schema.checks import one_of, require

SETTING = "data.prompts"
_FIX = ("give a .jsonl / .parquet file, a glob (data/*.parquet), a list of them, or a mixture "
        "{file: weight} / [{path: file, weight: 3}]")


@dataclass(frozen=True)
class Source:
    """One part of the dataset: files (or globs) read as one, drawn by `weight` in a mixture
    (None: data.prompts is no mixture, every row equally likely)."""
    paths: tuple[str, ...]
    weight: float | None = None

    @property
    def name(self) -> str:
        return self.paths[0] if len(self.paths) == 1 else "[" + ", ".join(self.paths) + "]"


def _plain(value):
    """omegaconf containers as plain lists and dicts (the schema may hand either)."""
    if hasattr(value, "_is_none"):   # a DictConfig / ListConfig
        from omegaconf import OmegaConf
        return OmegaConf.to_container(value, resolve=True)
    return value


def _paths(value, where: str) -> tuple[str, ...]:
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(p, str) and p.strip() for p in items):
        raise ConfigError(f"{where}={value!r}: a source is a file name or glob (text), or a list of them: {_FIX}")
    return tuple(items)


def _weight(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{where}: weight {value!r} is not a number > 0: give each source a positive weight "
                          f"(they need not sum to 1: 3 and 1 draw 3:1)")
    return float(value)


def parse_sources(value, setting: str = SETTING) -> list[Source]:
    """The sources of data.prompts: a text (a file or glob) or a list of texts is one source,
    no weight; a mapping {file or glob: weight} or a list of {path, weight} mappings (path a
    text or a list of them) is a mixture. ConfigError in one line naming `setting`."""
    value = _plain(value)
    if isinstance(value, str):
        return [Source(_paths(value, setting))]
    if isinstance(value, dict):
        if not value:
            raise ConfigError(f"{setting}={{}} names no source: {_FIX}")
        return [Source(_paths(str(k), setting), _weight(w, f"{setting}[{k!r}]")) for k, w in value.items()]
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{setting}={value!r} names no data: {_FIX}")
    if all(isinstance(v, str) for v in value):
        return [Source(_paths(value, setting))]
    sources = []
    for i, entry in enumerate(value):
        where = f"{setting}[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"path", "weight"}:
            raise ConfigError(f"{where}={entry!r}: a mixture's entries are each {{path: file, weight: number}} "
                              f"(a list of only file names is one dataset): {_FIX}")
        sources.append(Source(_paths(entry["path"], where + ".path"), _weight(entry["weight"], where)))
    return sources


@dataclass
class DataConfig:
    # .jsonl or .parquet file, one record per row; a glob (data/*.parquet) or a list of them (one
    # dataset); or a mixture drawn by weight, {file or glob: weight} or [{path: ..., weight: ...}] (docs/data.md)
    prompts: Any = "artifacts/tiny_countdown/prompts.jsonl"
    # field names; a dotted name reaches into an object (reward_model.ground_truth)
    prompt_key: str = "prompt"         # field of each record holding the prompt text (or chat messages: veRL's rows)
    # or: the field holding chat messages [{role, content}], rendered with the tokenizer's chat template
    messages_key: str = "messages"
    answer_key: str = "answer"         # field holding the gold answer (reward.fn=math | exact need it)
    shuffle: bool = True               # reshuffle each epoch (seeded by run.seed)
    system_prompt: str = ""            # chat rows: a system message put first where a row has none ("": none)
    # keyword arguments of the chat template, e.g. {enable_thinking: false} (Qwen3)
    chat_template_kwargs: dict = field(default_factory=dict)
    # prompts longer than this many tokens are dropped (0: no limit but the engines' context,
    # rollout.engines.max_model_len - rollout.sampling.max_new_tokens, which applies always)
    max_prompt_tokens: int = 0
    # what too long prompts do: drop (counted: data_prompts_dropped; the first few logged) | error (stop the run)
    overlong_prompts: str = "drop"

    def __post_init__(self):
        parse_sources(self.prompts)
        for key in ("prompt_key", "messages_key", "answer_key"):
            require(bool(str(getattr(self, key)).strip()), f"data.{key}", getattr(self, key),
                     "must name a field of the data rows")
        require(self.max_prompt_tokens >= 0, "data.max_prompt_tokens", self.max_prompt_tokens,
                 "must be >= 0 (0: only the engines' context limits prompts)")
        one_of("data.overlong_prompts", self.overlong_prompts, ("drop", "error"))
        require(all(isinstance(k, str) for k in self.chat_template_kwargs), "data.chat_template_kwargs",
                 self.chat_template_kwargs, "names the chat template's variables: give text keys")


@dataclass
class RewardConfig:
    fn: str = "countdown"              # verifier: countdown | math | exact | format | none (no verifier; docs/data.md)
    model_path: str = ""               # HF *ForSequenceClassification reward model, scored on the trainer ranks
    model_coef: float = 1.0            # score = verifier + model_coef * reward model
    # a verifier call taking longer than this (one sample, or one batch of a batched verifier)
    # scores its samples 0 (counted: reward_timeouts)
    timeout_s: float = 5.0
    # verifier calls at once, off the engines' event loop (threads, async tasks, or worker
    # processes of an isolated verifier; megarl/rewards/runner.py): raise it for a slow reward
    concurrency: int = 4
    # a batched verifier (@verifier(batched=True)) gets whole groups, up to this many samples per
    # call (a group larger than this alone); 0: one group per call
    batch_size: int = 0
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
        require(self.timeout_s > 0, "reward.timeout_s", self.timeout_s, "must be > 0 (seconds per call)")
        require(self.concurrency >= 1, "reward.concurrency", self.concurrency,
                 "must be >= 1 (verifier calls running at once)")
        require(self.batch_size >= 0, "reward.batch_size", self.batch_size,
                 "must be >= 0 (samples per call of a batched verifier; 0: one group per call)")
        require(self.fn != "none" or bool(self.model_path), "reward.fn", self.fn,
                 "with reward.fn=none set reward.model_path, or nothing scores the samples")
        require(bool(self.model_path) or self.model_coef == 1.0, "reward.model_coef", self.model_coef,
                 "weighs the reward model, but reward.model_path is empty: set reward.model_path, "
                 "or remove reward.model_coef")
