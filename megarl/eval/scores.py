"""The evaluation's figures per prompt and per dataset, as pure functions of rewards and answers.

For a prompt with n samples of which c are correct (reward >= eval.pass_threshold):
- mean@n: the mean reward of its samples (the verifier's reward, partial credit included);
- pass@k: the chance that at least one of k samples drawn without replacement from the n is
  correct, 1 - C(n - c, k) / C(n, k): the unbiased estimator of Chen et al. (2021), computed
  as a product so large n never overflows;
- maj@n: whether the most frequent answer among the samples that state one is correct (ties:
  the answer stated first; no sample states one: 0). Answers come from the verifier's answer
  extractor (eval/answers.py); a dataset whose verifier has none reports no maj@n.
Each dataset's figure is the mean over its prompts.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: n samples, c of them correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:   # every draw of k holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):   # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
        miss *= 1.0 - k / i
    return 1.0 - miss


def majority_correct(answers: Sequence[Optional[str]], correct: Sequence[bool]) -> float:
    """maj@n of one prompt: 1.0 when the most frequent stated answer is correct (the mean of
    its samples' correctness, which a deterministic verifier makes 0 or 1), else 0.0."""
    if len(answers) != len(correct):
        raise ValueError(f"{len(answers)} answers for {len(correct)} samples")
    stated = [a for a in answers if a is not None]
    if not stated:
        return 0.0
    counts = Counter(stated)
    best = max(counts.values())
    top = next(a for a in stated if counts[a] == best)   # ties: the answer stated first
    marks = [ok for a, ok in zip(answers, correct) if a == top]
    return sum(marks) / len(marks)


def prompt_scores(rewards: Sequence[float], threshold: float, ks: Sequence[int],
                  answers: Optional[Sequence[Optional[str]]] = None) -> dict:
    """One prompt's figures from its n samples' rewards (and answers, when comparable)."""
    n = len(rewards)
    correct = [r >= threshold for r in rewards]
    out = {f"mean@{n}": sum(rewards) / n}
    out.update({f"pass@{k}": pass_at_k(n, sum(correct), k) for k in ks})
    if answers is not None:
        out[f"maj@{n}"] = majority_correct(answers, correct)
    return out


def dataset_scores(per_prompt: Sequence[dict]) -> dict:
    """The mean of each figure over the prompts (every prompt reports the same keys)."""
    if not per_prompt:
        return {}
    return {key: sum(p[key] for p in per_prompt) / len(per_prompt) for key in per_prompt[0]}
