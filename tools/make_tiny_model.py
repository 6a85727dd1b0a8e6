#!/usr/bin/env python
"""Build the tiny countdown policy used by megarl's CPU tests and the PPO demo.

    python tools/make_tiny_model.py --out .tmp/tiny [--seed 0] [--num-prompts 4096] [--warmup-steps K]
        [--arch qwen2|qwen3] [--force]

Writes into DIR:
    config.json, generation_config.json, model.safetensors   random Qwen2ForCausalLM (or --arch's,
                                                             tools/tiny_archs.py), warmed up
    tokenizer.json, tokenizer_config.json,                   word-level tokenizer (AutoTokenizer;
    tokenization_countdown.py                                see megarl.data.countdown.build_tokenizer)
    prompts.jsonl   --num-prompts train records (make_records(num, seed))
    eval.jsonl      256 eval records (make_records(256, seed + EVAL_SEED_OFFSET))
    build_info.json arguments, measured warm/oracle reward, timings (written last)

Warm-up: a short SFT (AdamW, fp32, CPU) on a MIXTURE of targets: with probability ``P_CORRECT``
the correct countdown, otherwise the wrong "count down by 2" mode (both end with eos). The
warmed-up policy picks a mode at the 2nd answer token and then continues consistently, so
sampling at temperature 1 scores well below the correct-mode bound: PPO only has to sharpen one
decision to gain a lot of reward. Half the warm-up prompts use N ~ Uniform{1..48} so the rare
long counts are learned too.

Why P_CORRECT = 0.25 and not 0.5: with m = P(correct mode | N >= 2), the reward is about
0.29 + 0.68 * m (N = 1 is always right, the wrong mode earns ~1/(N+1), the correct mode ~0.97),
so m = 0.5 would give ~0.63, above the 0.35-0.55 band wanted for the demo's starting point and
with only ~0.35 of headroom. The warmed-up model's m is not exactly P_CORRECT and varies with the
seed (0.23 / 0.26 / 0.28 for seeds 0 / 1 / 2 at P_CORRECT = 0.25); the warm reward then lands at
0.41 / 0.50 / 0.48 with the oracle at 0.98-0.99 (256 eval samples, temperature 1).

"oracle_reward" in build_info.json is the same warm model evaluated with the 2nd answer token
forced to the correct one (n(N-1)), i.e. the reward a policy reaches by fixing the mode choice alone.

The build is skipped when DIR/build_info.json already records the same arguments (use --force).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

# Two OpenMP threads on two cores that other jobs share: with the default ACTIVE wait policy a
# thread spins whenever its partner is descheduled, and the warm-up ran 10x slower (measured:
# 10 steps in 36-64 s instead of ~5 s next to two busy processes). PASSIVE waiting removes that.
# It only takes effect if set before torch is first imported (true when run as a script).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

# Make the script runnable as `python tools/make_tiny_model.py` from a checkout.
_TOOLS = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(_TOOLS)
for _p in (_REPO_ROOT, _TOOLS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import tiny_archs  # noqa: E402  (tools/: the tiny architectures)

from megarl.data import countdown as cd  # noqa: E402
from megarl.rewards.countdown import countdown_score  # noqa: E402

#: Bump when the recipe (model shape, warm-up, eval) changes, so cached builds are redone.
RECIPE_VERSION = 6

# Model shape of the default (Qwen2) policy; tools/tiny_archs.py holds every --arch.
MODEL_KWARGS = tiny_archs.model_kwargs(tiny_archs.DEFAULT)

# Warm-up recipe.
P_CORRECT = 0.25  # probability that a warm-up target is the correct countdown
WARMUP_STEPS = 200
WARMUP_BATCH = 64
WARMUP_MICRO_BATCHES = 4  # length-sorted micro-batches per step (gradient accumulation; less padding)
WARMUP_LR = 3e-3
WARMUP_WEIGHT_DECAY = 0.01
WARMUP_LR_WARMUP = 20  # linear lr warm-up steps, then cosine to 10%
# Fraction of warm-up examples with N ~ Uniform{1..48} instead of the task distribution: the long
# tail is rare in the task, and the count-down transitions n(k) -> n(k-1) for large k need data.
WARMUP_UNIFORM_FRAC = 0.5

# Seeds of the three record streams derived from --seed (all distinct).
EVAL_SEED_OFFSET = 10_000
WARMUP_SEED_OFFSET = 20_000

NUM_EVAL = 256
EVAL_MAX_NEW_TOKENS = 56
NUM_THREADS = 2


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
def make_model(seed: int, arch: str = tiny_archs.DEFAULT):
    """Random-init tiny model of `arch` (fp32, tools/tiny_archs.py); deterministic in seed."""
    return tiny_archs.make_model(seed, arch)


def num_params(model) -> int:
    """Total parameter count."""
    return sum(p.numel() for p in model.parameters())


def _ids(text: str) -> list[int]:
    return [cd.TOKEN_TO_ID[w] for w in text.split()]


# ---------------------------------------------------------------------------------------------
# Warm-up (SFT on the correct/wrong mode mixture)
# ---------------------------------------------------------------------------------------------
def warmup_example(n: int, rng: random.Random, p_correct: float = P_CORRECT) -> tuple[list[int], int]:
    """(token ids of prompt + target + eos, prompt length); target mode drawn with p_correct."""
    target = cd.correct_answer(n) if rng.random() < p_correct else cd.wrong_answer(n)
    prompt = _ids(cd.make_prompt(n))
    return prompt + _ids(target) + [cd.EOS_ID], len(prompt)


def _collate(examples: list[tuple[list[int], int]]):
    """Right-padded input_ids / attention_mask / labels (-100 on prompt and padding)."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), cd.PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, (ids, plen) in enumerate(examples):
        t = torch.tensor(ids, dtype=torch.long)
        input_ids[i, : len(ids)] = t
        attention_mask[i, : len(ids)] = 1
        labels[i, plen : len(ids)] = t[plen:]
    return input_ids, attention_mask, labels


def _warmup_batches(steps: int, batch: int, seed: int, p_correct: float):
    """Yield ``steps`` batches of fresh examples (N from the warm-up length mix, mode from p_correct).

    Each batch is a list of ``WARMUP_MICRO_BATCHES`` length-sorted micro-batches (collated) whose
    gradients are accumulated, which cuts padding without changing what a step sees. (Grouping
    examples by length ACROSS steps would save the same, but then each step holds one mode per
    N and the model's mode choice ends up badly calibrated: it mostly picks the wrong mode.)
    """
    records = cd.make_records(steps * batch, seed)
    rng = random.Random(seed)
    for step in range(steps):
        chunk = records[step * batch : (step + 1) * batch]
        ns = [rng.randint(cd.MIN_N, cd.MAX_N) if rng.random() < WARMUP_UNIFORM_FRAC else r["n"] for r in chunk]
        examples = sorted((warmup_example(n, rng, p_correct) for n in ns), key=lambda e: len(e[0]))
        size = math.ceil(len(examples) / WARMUP_MICRO_BATCHES)
        yield [_collate(examples[i : i + size]) for i in range(0, len(examples), size)]


def warmup(
    model,
    steps: int = WARMUP_STEPS,
    seed: int = 0,
    p_correct: float = P_CORRECT,
    batch: int = WARMUP_BATCH,
    lr: float = WARMUP_LR,
    progress: bool = True,
) -> float:
    """Supervised warm-up with AdamW; returns the mean loss of the last 20 steps."""
    from tqdm import tqdm

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WARMUP_WEIGHT_DECAY, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < WARMUP_LR_WARMUP:
            return lr * (step + 1) / WARMUP_LR_WARMUP
        frac = (step - WARMUP_LR_WARMUP) / max(1, steps - WARMUP_LR_WARMUP)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    torch.manual_seed(seed)
    losses: list[float] = []
    bar = tqdm(_warmup_batches(steps, batch, seed, p_correct), total=steps, desc="warm-up", disable=not progress)
    for step, micro_batches in enumerate(bar):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        # Token-mean loss over the whole batch: weight each micro-batch mean by its target count.
        n_targets = [int((labels[:, 1:] != -100).sum()) for _, _, labels in micro_batches]
        total = sum(n_targets)
        step_loss = 0.0
        for (input_ids, attention_mask, labels), k in zip(micro_batches, n_targets):
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss * (k / total)
            loss.backward()
            step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(step_loss)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{step_loss:.3f}")
    model.eval()
    tail = losses[-20:]
    return sum(tail) / max(1, len(tail))


# ---------------------------------------------------------------------------------------------
# Evaluation (HF generate, temperature 1)
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def _sample(model, prefixes: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], bool]]:
    """Pure temperature-1 sampling from equal-length prefixes; returns (new ids w/o eos, finished)."""
    if not prefixes:
        return []
    input_ids = torch.tensor(prefixes, dtype=torch.long)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=cd.EOS_ID,
        pad_token_id=cd.PAD_ID,
    )
    results = []
    for row in out[:, input_ids.shape[1] :].tolist():
        if cd.EOS_ID in row:
            results.append((row[: row.index(cd.EOS_ID)], True))
        else:
            results.append((row, False))
    return results


def evaluate(model, tokenizer, records: list[dict], seed: int = 0, oracle: bool = False) -> dict:
    """Mean countdown reward of temperature-1 samples (``max_new_tokens`` = 56 response tokens).

    Also reports exact-match rate, the sampled and the model-probability rate of choosing the
    correct mode at the 2nd answer token (N >= 2), response lengths (incl. eos) and reward by N bucket.

    With ``oracle=True`` the first two answer tokens are forced to "nN n(N-1)" (N >= 2; N = 1 is
    sampled freely since both modes coincide) and count as part of the response.
    """
    torch.manual_seed(seed)
    model.eval()
    forced: list[list[int]] = []
    for r in records:
        n = r["n"]
        forced.append(_ids(f"n{n} n{n - 1}") if (oracle and n >= 2) else [])
    responses: list[tuple[list[int], bool] | None] = [None] * len(records)
    # Group by forced length so every generate call has equal-length prefixes (no padding).
    for flen in sorted({len(f) for f in forced}):
        idx = [i for i, f in enumerate(forced) if len(f) == flen]
        prefixes = [_ids(records[i]["prompt"]) + forced[i] for i in idx]
        for i, (new, fin) in zip(idx, _sample(model, prefixes, EVAL_MAX_NEW_TOKENS - flen)):
            responses[i] = (forced[i] + new, fin)

    # Noise-free view of the mode choice: P(n(N-1) | prompt, nN) under the model, for N >= 2.
    multi_recs = [r for r in records if r["n"] >= 2]
    mode_prob = None
    if multi_recs:
        with torch.no_grad():
            x = torch.tensor([_ids(r["prompt"]) + [cd.TOKEN_TO_ID[f"n{r['n']}"]] for r in multi_recs])
            probs = model(input_ids=x).logits[:, -1].float().softmax(-1)
            want = torch.tensor([cd.TOKEN_TO_ID[f"n{r['n'] - 1}"] for r in multi_recs])
            mode_prob = probs.gather(1, want[:, None]).mean().item()

    rewards, exact, correct_mode, multi = [], 0, 0, 0
    by_bucket: dict[str, list[float]] = {"short(1-6)": [], "medium(7-29)": [], "long(30-48)": []}
    resp_lens = []
    for r, (ids, fin) in zip(records, responses):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        rew = countdown_score(text, r, finished=fin)
        rewards.append(rew)
        exact += rew == 1.0
        resp_lens.append(len(ids) + int(fin))
        n = r["n"]
        bucket = "short(1-6)" if n <= 6 else ("medium(7-29)" if n <= 29 else "long(30-48)")
        by_bucket[bucket].append(rew)
        if n >= 2:
            multi += 1
            correct_mode += len(ids) >= 2 and ids[1] == cd.TOKEN_TO_ID[f"n{n - 1}"]
    return {
        "mean_reward": sum(rewards) / len(rewards),
        "exact_frac": exact / len(rewards),
        "correct_mode_frac": correct_mode / max(1, multi),
        "correct_mode_prob": mode_prob,
        "mean_response_tokens": sum(resp_lens) / len(resp_lens),
        "max_response_tokens": max(resp_lens),
        "reward_by_length": {k: (sum(v) / len(v) if v else None) for k, v in by_bucket.items()},
    }


# ---------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------
_REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenization_countdown.py",
    "prompts.jsonl",
    "eval.jsonl",
)


def build_args(seed: int, num_prompts: int, warmup_steps: int, recipe_version: int = RECIPE_VERSION,
               arch: str = tiny_archs.DEFAULT) -> dict:
    """The arguments that identify a build (compared by ``is_built``); the default arch is left
    out, so builds made before --arch existed stay valid."""
    args = {"seed": seed, "num_prompts": num_prompts, "warmup_steps": warmup_steps, "recipe_version": recipe_version}
    return args if arch == tiny_archs.DEFAULT else {**args, "arch": arch}


def is_built(out_dir: str, args: dict, required: tuple = _REQUIRED_FILES) -> bool:
    """True when out_dir holds a complete build (every file in `required`) made with exactly
    these arguments."""
    path = os.path.join(out_dir, "build_info.json")
    if not os.path.exists(path) or not all(os.path.exists(os.path.join(out_dir, f)) for f in required):
        return False
    try:
        with open(path) as f:
            return json.load(f).get("args") == args
    except (OSError, ValueError):
        return False


def reuse_or_clear(out_dir: str, args: dict, force: bool, required: tuple = _REQUIRED_FILES) -> dict | None:
    """The build_info of a complete build with these arguments (marked skipped), or None after
    making out_dir ready for a build: its build_info.json removed, so a half-rebuilt folder
    never looks complete (both builders)."""
    info_path = os.path.join(out_dir, "build_info.json")
    if not force and is_built(out_dir, args, required):
        with open(info_path) as f:
            info = json.load(f)
        info["skipped"] = True
        return info
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(info_path):
        os.remove(info_path)
    return None


def build(
    out_dir: str,
    seed: int = 0,
    num_prompts: int = 4096,
    warmup_steps: int = WARMUP_STEPS,
    force: bool = False,
    progress: bool = True,
    arch: str = tiny_archs.DEFAULT,
) -> dict:
    """Build (or reuse) the tiny countdown model of `arch` in out_dir; returns the build_info dict."""
    torch.set_num_threads(NUM_THREADS)
    args = build_args(seed, num_prompts, warmup_steps, arch=arch)
    done = reuse_or_clear(out_dir, args, force)
    if done is not None:
        return done
    t0 = time.perf_counter()
    info_path = os.path.join(out_dir, "build_info.json")

    tokenizer = cd.build_tokenizer(out_dir)
    model = make_model(seed, arch)
    t_init = time.perf_counter() - t0

    final_loss = warmup(model, steps=warmup_steps, seed=seed + WARMUP_SEED_OFFSET, progress=progress)
    t_warm = time.perf_counter() - t0 - t_init

    model.save_pretrained(out_dir, safe_serialization=True)
    prompts = cd.make_records(num_prompts, seed)
    eval_records = cd.make_records(NUM_EVAL, seed + EVAL_SEED_OFFSET)
    cd.write_jsonl(os.path.join(out_dir, "prompts.jsonl"), prompts)
    cd.write_jsonl(os.path.join(out_dir, "eval.jsonl"), eval_records)
    t_build = time.perf_counter() - t0

    warm = evaluate(model, tokenizer, eval_records, seed=seed)
    oracle = evaluate(model, tokenizer, eval_records, seed=seed, oracle=True)
    t_total = time.perf_counter() - t0

    info = {
        "args": args,
        "model": {**tiny_archs.model_kwargs(arch), "architecture": model.config.architectures[0],
                  "num_params": num_params(model)},
        "warmup": {
            "steps": warmup_steps,
            "batch": WARMUP_BATCH,
            "lr": WARMUP_LR,
            "micro_batches": WARMUP_MICRO_BATCHES,
            "p_correct": P_CORRECT,
            "uniform_length_frac": WARMUP_UNIFORM_FRAC,
            "final_loss": final_loss,
        },
        "length_distribution": {
            "mixture": [list(c) for c in cd.LENGTH_MIXTURE],
            "mean": cd.LENGTH_MEAN,
            "max": cd.MAX_N,
        },
        "eval": {"num": NUM_EVAL, "temperature": 1.0, "max_new_tokens": EVAL_MAX_NEW_TOKENS},
        "warm_reward": warm["mean_reward"],
        "oracle_reward": oracle["mean_reward"],
        "warm_eval": warm,
        "oracle_eval": oracle,
        "seconds": {
            "init": round(t_init, 2),
            "warmup": round(t_warm, 2),
            "build": round(t_build, 2),
            "total_with_eval": round(t_total, 2),
        },
    }
    with open(info_path + ".tmp", "w") as f:
        json.dump(info, f, indent=2)
    os.replace(info_path + ".tmp", info_path)
    info["skipped"] = False
    return info


def summary(info: dict, out_dir: str) -> str:
    """A few human-readable lines about a build_info dict."""
    w, o = info["warm_eval"], info["oracle_eval"]
    verb = "reused" if info.get("skipped") else "built"
    prob = w["correct_mode_prob"]
    prob_s = "-" if prob is None else f"{prob:.2f}"
    return "\n".join(
        [
            f"{verb} {out_dir}: {info['model'].get('architecture', 'Qwen2ForCausalLM')} "
            f"{info['model']['num_params']:,} params, "
            f"warm-up {info['warmup']['steps']} steps (final loss {info['warmup']['final_loss']:.3f})",
            f"  warm reward   {w['mean_reward']:.3f}  (exact {w['exact_frac']:.2f}, correct mode "
            f"{w['correct_mode_frac']:.2f} sampled / {prob_s} prob; {_fmt(w['reward_by_length'])})",
            f"  oracle reward {o['mean_reward']:.3f}  (exact {o['exact_frac']:.2f}; {_fmt(o['reward_by_length'])})",
            f"  seconds: {info['seconds']}",
        ]
    )


def _fmt(d: dict) -> str:
    return ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} -" for k, v in d.items())


def parse_args(argv=None, doc: str = __doc__, warmup_steps: int = WARMUP_STEPS,
               archs: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=4096, help="records in prompts.jsonl")
    p.add_argument("--warmup-steps", type=int, default=warmup_steps)
    p.add_argument("--force", action="store_true", help="rebuild even if build_info.json matches")
    if archs:
        p.add_argument("--arch", choices=sorted(tiny_archs.ARCHS), default=tiny_archs.DEFAULT,
                       help="the model's architecture (tools/tiny_archs.py)")
    return p.parse_args(argv)


def run_cli(argv, build_fn, summary_fn, doc: str, warmup_steps: int, archs: bool = False) -> dict:
    """The builders' command line (this one and tools/make_tiny_agent_model.py): parse, build
    or reuse, print the summary. archs: the builder takes --arch."""
    a = parse_args(argv, doc, warmup_steps, archs)
    extra = {"arch": a.arch} if archs else {}
    info = build_fn(a.out, seed=a.seed, num_prompts=a.num_prompts, warmup_steps=a.warmup_steps, force=a.force,
                    **extra)
    print(summary_fn(info, a.out))
    return info


def main(argv=None) -> dict:
    return run_cli(argv, build, summary, __doc__, WARMUP_STEPS, archs=True)


if __name__ == "__main__":
    main()
