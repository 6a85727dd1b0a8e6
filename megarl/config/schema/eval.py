"""Held-out evaluation during a run (`eval.*`, docs/evaluation.md)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePath

from megarl.config.registry import VERIFIERS
from megarl.config.schema.checks import changed, require


@dataclass
class EvalConfig:
    # .jsonl / .parquet files read as data.prompts is (same data.*_key fields); empty: no evaluation.
    # Each is reported under eval/<name>/...: `NAME=path` names it; else its file name without
    # extension, with as many of its folders before it (joined by _) as tell it from the others
    datasets: list[str] = field(default_factory=list)
    # the verifier of each dataset, in order (one entry: all of them); empty: reward.fn for all
    verifiers: list[str] = field(default_factory=list)
    every: int = 0                     # evaluate every this many steps (0: only before training and at the end)
    at_start: bool = True              # evaluate the starting weights, before step 0 trains
    n: int = 1                         # samples per prompt
    k: list[int] = field(default_factory=lambda: [1])   # pass@k reported for each k (each <= n)
    temperature: float = 0.0           # 0: greedy; > 0: sampled, seeded by run.seed (the same draws at each evaluation)
    # nucleus sampling (sampled evaluation only), the evaluation's own: rollout.sampling.top_p
    # (and top_k) do not apply to it
    top_p: float = 1.0
    max_new_tokens: int = 0            # response budget in tokens; 0: rollout.sampling.max_new_tokens
    max_prompts: int = 0               # the first this many prompts of each dataset; 0: all of them
    # a sample counts as correct (pass@k, maj@n) when its verifier's reward is at least this
    pass_threshold: float = 1.0
    concurrency: int = 256             # evaluation requests in flight at once (beside the round's own)
    dump: bool = True                  # every sample to <run.dir>/eval/<dataset>/step_<N>.jsonl

    def __post_init__(self):
        on = bool(self.datasets)
        unused = [] if on else changed(self, {f for f in self.__dataclass_fields__ if f != "datasets"})
        require(not unused, f"eval.{unused[0] if unused else ''}", getattr(self, unused[0]) if unused else None,
                 "is an evaluation setting, and eval.datasets is empty: list the held-out files in "
                 "eval.datasets=[path.jsonl], or remove it")
        for path in self.paths:
            require(bool(str(path).strip()), "eval.datasets", list(self.datasets), "holds an empty path")
        names = self.names
        for name in names:
            require(names.count(name) == 1, "eval.datasets", list(self.datasets),
                    f"two datasets are named {name!r} (each is reported under eval/<name>): name them, "
                    f"e.g. eval.datasets=[a={self.paths[names.index(name)]},...]")
        require(len(self.verifiers) in (0, 1, len(self.datasets)), "eval.verifiers", list(self.verifiers),
                 f"give one verifier per dataset ({len(self.datasets)}), one for all of them, or none "
                 f"(reward.fn)")
        for i, v in enumerate(self.verifiers):
            VERIFIERS.check(v, f"eval.verifiers[{i}]")
        require(self.every >= 0, "eval.every", self.every, "must be >= 0 (0: before training and at the end only)")
        require(self.n >= 1, "eval.n", self.n, "must be >= 1 (samples per prompt)")
        require(bool(self.k), "eval.k", list(self.k), "list at least one k, e.g. eval.k=[1]")
        for k in self.k:
            require(1 <= k <= self.n, "eval.k", list(self.k),
                    f"pass@{k} needs k between 1 and eval.n={self.n}: raise eval.n or lower k")
        require(self.temperature >= 0, "eval.temperature", self.temperature, "must be >= 0 (0: greedy)")
        require(self.temperature > 0 or self.n == 1, "eval.n", self.n,
                 "with eval.temperature=0 (greedy) every sample of a prompt is the same response: "
                 "set eval.n=1, or eval.temperature > 0")
        require(0 < self.top_p <= 1, "eval.top_p", self.top_p, "must be in (0, 1] (1: no nucleus cut)")
        require(self.top_p == 1 or self.temperature > 0, "eval.top_p", self.top_p,
                "cuts the nucleus of a sampled evaluation, and eval.temperature=0 is greedy: set "
                "eval.temperature > 0, or remove eval.top_p")
        require(self.max_new_tokens >= 0, "eval.max_new_tokens", self.max_new_tokens,
                 "must be >= 0 (0: rollout.sampling.max_new_tokens)")
        require(self.max_prompts >= 0, "eval.max_prompts", self.max_prompts, "must be >= 0 (0: every prompt)")
        require(self.concurrency >= 1, "eval.concurrency", self.concurrency, "must be >= 1")

    def verifier_of(self, index: int, default: str) -> str:
        """The verifier of dataset `index`: its entry in eval.verifiers, else `default` (reward.fn)."""
        if not self.verifiers:
            return default
        return self.verifiers[index if len(self.verifiers) > 1 else 0]

    @property
    def paths(self) -> list[str]:
        """Each dataset's file (an entry `NAME=path` less its name)."""
        return [split_entry(d)[1] for d in self.datasets]

    @property
    def names(self) -> list[str]:
        """Each dataset's name in metric keys and dump folders (`dataset_names`)."""
        return dataset_names(self.datasets)


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def split_entry(entry) -> tuple[str, str]:
    """An eval.datasets entry as (its explicit name or "", its path): `gsm=data/test.jsonl`."""
    name, eq, path = str(entry).partition("=")
    return (name, path) if eq and _NAME.fullmatch(name) else ("", str(entry))


def dataset_names(entries: list) -> list[str]:
    """The explicit `NAME=` of each entry, else its path's file name without extension, with as
    many of the folders before it (joined by _) as it takes to tell it from the other unnamed
    entries: data/gsm8k/test.jsonl and data/math/test.jsonl are gsm8k_test and math_test."""
    split = [split_entry(e) for e in entries]
    parts = [list(PurePath(p).with_suffix("").parts) if p.strip() else [""] for _, p in split]
    names = []
    for i, (name, _) in enumerate(split):
        if name:
            names.append(name)
            continue
        depth = 1
        others = [parts[j] for j, (n, _) in enumerate(split) if j != i and not n]
        while depth < len(parts[i]) and any(o[-depth:] == parts[i][-depth:] for o in others):
            depth += 1
        names.append("_".join(parts[i][-depth:]))
    return names


def check_eval(cfg) -> None:
    """eval.* against the other sections (`cfg`: a RootConfig): the rollout it runs beside, and
    a dataset left to reward.fn needs one that scores."""
    e, r = cfg.eval, cfg.rollout
    if not e.datasets:
        return
    # keep mode: a round's end pauses the engines holding every request on them. An async round of
    # elastic steps (max_step_multiple > 1) ends only when its step asks for it, after the step's
    # evaluation; one of fixed steps ends on its own as soon as it has its groups, which may be in
    # the middle of an evaluation, whose requests would then wait for the next push
    fixed = r.partial.max_step_multiple == 1
    require(not (r.mode == "partial" and r.partial.asynchronous and r.update_mode == "keep" and fixed),
            "rollout.update_mode", r.update_mode, "with rollout.partial.async and rollout.partial.max_step_multiple=1 "
            "the round may end during an evaluation and hold its requests until the next push: use "
            "rollout.update_mode=abort or rollout.partial.max_step_multiple > 1 with eval.datasets, "
            "or remove eval.datasets")
    budget = e.max_new_tokens or r.sampling.max_new_tokens
    require(budget < r.engines.max_model_len, "eval.max_new_tokens", e.max_new_tokens,
            f"a response budget of {budget} tokens does not fit the engines' context, "
            f"rollout.engines.max_model_len={r.engines.max_model_len}, with a prompt beside it: lower "
            f"eval.max_new_tokens or raise rollout.engines.max_model_len")
    if e.verifiers and len(e.verifiers) in (1, len(e.datasets)):
        return
    scored_elsewhere = cfg.env.name or cfg.rollout.mode == "service" or cfg.reward.fn == "none"
    require(not scored_elsewhere, "eval.verifiers", list(e.verifiers),
            "the evaluation scores each dataset with a verifier, and this run's reward.fn scores nothing "
            "(env.name, rollout.mode=service or reward.fn=none): name one, e.g. eval.verifiers=[math]")
