"""One dataset's evaluation from its samples: the figures (eval/scores.py), the dump a reader
can recompute them from, and the console line.

Metric keys are `eval/<dataset>/<figure>`: mean@n, pass@k for each k of eval.k, maj@n (where
the verifier's answers compare, eval/answers.py), response_len_mean, finished_frac, prompts,
refused (requests the engines refused as invalid: they score 0) and the verifier's
reward_errors / reward_timeouts. The dump, `<run.dir>/eval/<dataset>/step_<N>.jsonl`, holds one
row per sample: rollout/controller/dump.py's record plus prompt_index, sample_index, answer and correct.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Optional

from megarl.data.sample import Sample
from megarl.eval.scores import dataset_scores, prompt_scores
from megarl.rollout.controller.dump import sample_record
from megarl.rollout.controller.sync_rollout import REFUSED


def per_prompt(samples: list[Sample], n: int, threshold: float, ks, answers: Optional[list]) -> list[dict]:
    """Each prompt's figures, from its n consecutive samples (and their answers)."""
    out = []
    for start in range(0, len(samples), n):
        rewards = [s.reward for s in samples[start:start + n]]
        out.append(prompt_scores(rewards, threshold, ks, None if answers is None else answers[start:start + n]))
    return out


def answers_of(samples: list[Sample], tokenizer, extract: Optional[Callable]) -> Optional[list]:
    """Each sample's stated answer (None: it states none, or was refused); None when the
    verifier's answers do not compare."""
    if extract is None:
        return None
    return [None if s.finish_reason == REFUSED else
            extract(tokenizer.decode(s.response_ids, skip_special_tokens=True), s.stopped) for s in samples]


def dataset_metrics(name: str, samples: list[Sample], answers: Optional[list], n: int, threshold: float,
                    ks, counts: dict) -> dict:
    """The metrics row's part of one dataset (keys eval/<name>/...)."""
    figures = dataset_scores(per_prompt(samples, n, threshold, ks, answers))
    lengths = [len(s.response_ids) for s in samples]
    figures.update({"response_len_mean": sum(lengths) / len(lengths),
                    "finished_frac": sum(s.stopped for s in samples) / len(samples),
                    "prompts": len(samples) // n,
                    "refused": sum(s.finish_reason == REFUSED for s in samples), **counts})
    return {f"eval/{name}/{k}": v for k, v in figures.items()}


def dump_eval(run_dir: str, name: str, version: int, samples: list[Sample], answers: Optional[list],
              n: int, threshold: float, tokenizer) -> str:
    """Every sample of one dataset's evaluation of `version`, written atomically."""
    folder = os.path.join(run_dir, "eval", name)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step_{version}.jsonl")
    with open(path + ".tmp", "w") as f:
        for i, s in enumerate(samples):
            row = {**sample_record(s, tokenizer), "prompt_index": i // n, "sample_index": i % n,
                   "answer": None if answers is None else answers[i], "correct": s.reward >= threshold}
            f.write(json.dumps(row) + "\n")
    os.replace(path + ".tmp", path)
    return path


def console_line(version: int, names: list[str], metrics: dict, seconds: float) -> str:
    """One line for the whole evaluation: each dataset's mean@n, pass@k, maj@n and length."""
    parts = []
    for name in names:
        prefix = f"eval/{name}/"
        shown = [f"{k[len(prefix):]}={v:.3g}" for k, v in metrics.items()
                 if k.startswith(prefix) and k[len(prefix):].split("@")[0] in ("mean", "pass", "maj")]
        shown.append(f"len={metrics[prefix + 'response_len_mean']:.3g}")
        parts.append(f"{name} " + " ".join(shown))
    return f"eval {version:4d} | " + " | ".join(parts) + f" | {seconds:.1f}s"
