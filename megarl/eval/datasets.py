"""The held-out datasets of eval.datasets, loaded and checked before anything starts."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from megarl.config.errors import ConfigError
from megarl.data.prompts import check_chat_template, load_prompts
from megarl.rewards import needs_answer

log = logging.getLogger("megarl.eval")


@dataclass
class EvalSet:
    """One held-out dataset: its name in metric keys, its file, its verifier and its records."""
    index: int            # position in eval.datasets (its seeds derive from it)
    name: str
    path: str
    verifier: str         # a registered name or an import path
    records: list


def load_eval_sets(cfg, training: list | None = None) -> list[EvalSet]:
    """Every file of cfg.eval.datasets read as data.prompts is (data.*_key fields; the gold
    answer required where the dataset's verifier compares with one, chat rows rendered by the
    model's chat template), cut to eval.max_prompts.
    A missing or malformed file is a ConfigError naming eval.datasets[i]; a dataset sharing
    prompts with the `training` records is warned about (its score is not held-out)."""
    e, d = cfg.eval, cfg.data
    sets = []
    for i, (path, name) in enumerate(zip(e.paths, e.names)):
        verifier = e.verifier_of(i, cfg.reward.fn)
        setting = f"eval.datasets[{i}]"   # errors name the file by the setting that gave it
        try:
            records = load_prompts(str(path), d.prompt_key, d.messages_key,
                                   d.answer_key if needs_answer(verifier) else None, setting=setting)
        except FileNotFoundError as err:   # a setting's bad value, found before anything starts
            raise ConfigError(str(err)) from None
        # chat rows need the model's chat template (the tokenizer is loaded only for them)
        check_chat_template(records, cfg.model.path, d.prompt_key, d.messages_key, str(path), setting=setting)
        if e.max_prompts:
            records = records[: e.max_prompts]
        sets.append(EvalSet(i, name, str(path), verifier, list(records)))
        shared = _shared_prompts(records, training or [], d.prompt_key, d.messages_key)
        if shared:
            log.warning("megarl: eval.datasets[%d]=%r: %d of its %d prompts are also in data.prompts, so its "
                        "figures are not held-out on them", i, str(path), shared, len(records))
    return sets


def _shared_prompts(records: list, training: list, prompt_key: str, messages_key: str) -> int:
    """How many of `records` have a prompt (text or chat) that a training record has too."""
    def prompt(r):
        return json.dumps(r.get(prompt_key, r.get(messages_key)), sort_keys=True)
    seen = {prompt(r) for r in training}
    return sum(prompt(r) in seen for r in records)
