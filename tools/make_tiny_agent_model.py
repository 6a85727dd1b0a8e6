#!/usr/bin/env python
"""Build the tiny "guess the number" agent policy (megarl/data/guess.py, megarl/envs/guess.py).

    python tools/make_tiny_agent_model.py --out artifacts/tiny_guess [--seed 0] [--num-prompts 4096]
        [--warmup-steps K] [--force]

Writes into DIR:
    config.json, generation_config.json, model.safetensors   random Qwen2ForCausalLM (countdown's
                                                             shape, tools/make_tiny_model.py), warmed up
    tokenizer.json, tokenizer_config.json (with the chat template), tokenization_countdown.py
    prompts.jsonl   --num-prompts train records (guess.make_records(num, seed))
    eval.jsonl      NUM_EVAL eval records (seed + EVAL_SEED_OFFSET)
    build_info.json arguments, measured warm / oracle win rates, exact policy win rates, timings (last)

Warm-up: supervised training on whole-episode transcripts, tokens exactly as an agent rollout
lays them out (the prompt, then per turn the guess and its eos, then the renderer's observation
delta [<user>, word, <bot>]), loss on the model's tokens only. Each transcript guess is drawn,
with probability ``P_USE``, uniformly from the numbers still consistent with the answers so far,
otherwise uniformly from 1..K (ignoring them). The warmed-up policy thus mostly ignores the
feedback: RL has to learn to use it. Exact win rates of these data policies within 4 turns
(K = 8, ``policy_win_rate``): P_USE = 0 -> 0.414, 0.2 -> 0.505, 1 -> 0.844; binary search -> 1.0.

Why P_USE = 0.2: the warm model follows the feedback a little less than its data (consistent
guesses 0.67), so it wins below the data policy's 0.505: 0.426 / 0.445 / 0.439 for seeds
0 / 1 / 2, with the oracle at 0.840 / 0.857 / 0.861 (NUM_EVAL episodes, temperature 1). That is
inside the 0.35-0.55 band wanted for RL's starting point, with >= 0.55 of headroom to binary search.

"oracle" is the same warm model with the first token of every turn restricted to the consistent
numbers (its own probabilities renormalised there): what using the feedback alone would give.

The build is skipped when DIR/build_info.json already records the same arguments (use --force).
"""
from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from functools import lru_cache

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # why: tools/make_tiny_model.py (before torch)

import torch  # noqa: E402

_TOOLS = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(_TOOLS)
for _p in (_REPO_ROOT, _TOOLS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import make_tiny_model as base  # noqa: E402  (the countdown builder: model shape, init, threads)

from megarl.data import guess as task  # noqa: E402
from megarl.envs.guess import answer  # noqa: E402
from megarl.envs.render import ObservationRenderer  # noqa: E402

#: Bump when the recipe (model, transcripts, warm-up, eval) changes, so cached builds are redone.
RECIPE_VERSION = 1

MAX_TURNS = 4            # env.max_turns of recipes/tiny_agent_cpu.yaml
MAX_NEW_TOKENS = 24      # rollout.sampling.max_new_tokens there: the whole episode's response budget
K = task.DEFAULT_K

# Warm-up recipe.
P_USE = 0.2              # probability that a transcript guess uses the feedback (see module doc)
WARMUP_STEPS = 200
WARMUP_BATCH = 64
WARMUP_LR = 3e-3
WARMUP_WEIGHT_DECAY = 0.01
WARMUP_LR_WARMUP = 20    # linear lr warm-up steps, then cosine to 10%

EVAL_SEED_OFFSET = base.EVAL_SEED_OFFSET
WARMUP_SEED_OFFSET = base.WARMUP_SEED_OFFSET
NUM_EVAL = 512


# ---------------------------------------------------------------------------------------------
# The data policies (pure)
# ---------------------------------------------------------------------------------------------
def data_guess(lo: int, hi: int, k: int, p_use: float, rng: random.Random) -> int:
    """One transcript guess: uniform in the consistent [lo, hi] with probability p_use, else in 1..k."""
    return rng.randint(lo, hi) if rng.random() < p_use else rng.randint(1, k)


def narrow(lo: int, hi: int, guess: int, observation: str) -> tuple[int, int]:
    """The interval still consistent after `observation` answered `guess` (invalid: unchanged)."""
    if observation == task.HIGHER:
        return max(lo, guess + 1), hi
    if observation == task.LOWER:
        return lo, min(hi, guess - 1)
    return lo, hi


def policy_win_rate(k: int, turns: int, p_use: float) -> float:
    """Exact win probability of the data policy with a secret uniform in 1..k.

    Given the answers, the secret is uniform over the consistent interval (each answer is 0/1
    likely), so win(lo, hi, t) averages over the guess g and the secret s in [lo, hi]."""
    @lru_cache(maxsize=None)
    def win(lo: int, hi: int, t: int) -> float:
        if t == 0:
            return 0.0
        width = hi - lo + 1
        total = 0.0
        for g in range(1, k + 1):
            q = (1 - p_use) / k + (p_use / width if lo <= g <= hi else 0.0)
            if q == 0.0:
                continue
            hit = 1.0 if lo <= g <= hi else 0.0
            above = max(0, hi - max(lo, g + 1) + 1)     # secrets > g still possible
            below = max(0, min(hi, g - 1) - lo + 1)      # secrets < g still possible
            value = hit / width
            if above:
                value += above / width * win(max(lo, g + 1), hi, t - 1)
            if below:
                value += below / width * win(lo, min(hi, g - 1), t - 1)
            total += q * value
        return total

    return win(1, k, turns)


# ---------------------------------------------------------------------------------------------
# Transcripts
# ---------------------------------------------------------------------------------------------
def prompt_ids(tokenizer, record: dict) -> list[int]:
    """The record's prompt ids, as megarl.data.prompts encodes chat rows."""
    text = tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def observation_deltas(renderer: ObservationRenderer) -> dict[str, list[int]]:
    """The ids each answer appends after a turn that ended on eos (three answers: rendered once)."""
    return {w: renderer.ids(w, last_token=task.EOS_ID) for w in (task.HIGHER, task.LOWER, task.INVALID)}


def transcript(prompt: list[int], deltas: dict[str, list[int]], secret: int, k: int, p_use: float,
               rng: random.Random) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one data-policy episode after `prompt`: 1 on each guess and its eos,
    0 on the prompt and the answers (`deltas`); no answer follows the last turn."""
    ids, mask = list(prompt), [0] * len(prompt)
    lo, hi = 1, k
    for turn in range(MAX_TURNS):
        g = data_guess(lo, hi, k, p_use, rng)
        ids += [task.TOKEN_TO_ID[task.number_word(g)], task.EOS_ID]
        mask += [1, 1]
        result = answer(task.number_word(g), secret, k)
        if result.done or turn == MAX_TURNS - 1:
            break
        obs = deltas[result.observation]
        ids += obs
        mask += [0] * len(obs)
        lo, hi = narrow(lo, hi, g, result.observation)
    return ids, mask


def _collate(examples: list[tuple[list[int], list[int]]]):
    """Right-padded input_ids / attention_mask / labels (-100 where the mask is 0 and on padding)."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), task.PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, (ids, mask) in enumerate(examples):
        t = torch.tensor(ids, dtype=torch.long)
        input_ids[i, : len(ids)] = t
        attention_mask[i, : len(ids)] = 1
        labels[i, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), t, torch.tensor(-100))
    return input_ids, attention_mask, labels


def lr_at(step: int, steps: int, lr: float) -> float:
    """Linear warm-up for WARMUP_LR_WARMUP steps, then cosine from lr down to 10% of it."""
    if step < WARMUP_LR_WARMUP:
        return lr * (step + 1) / WARMUP_LR_WARMUP
    frac = (step - WARMUP_LR_WARMUP) / max(1, steps - WARMUP_LR_WARMUP)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def warmup(model, tokenizer, steps: int, seed: int, p_use: float = P_USE, batch: int = WARMUP_BATCH,
           lr: float = WARMUP_LR) -> float:
    """Supervised warm-up on fresh data-policy transcripts; returns the mean loss of the last 20 steps."""
    deltas = observation_deltas(ObservationRenderer(tokenizer))
    rng = random.Random(seed)
    records = task.make_records(steps * batch, seed)
    # one chat prompt per range, rendered once (the records of one k share their messages)
    prompts = {r["k"]: prompt_ids(tokenizer, r) for r in {r["k"]: r for r in records}.values()}
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WARMUP_WEIGHT_DECAY, betas=(0.9, 0.98))
    torch.manual_seed(seed)
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        chunk = records[step * batch: (step + 1) * batch]
        examples = [transcript(prompts[r["k"]], deltas, r["secret"], r["k"], p_use, rng) for r in chunk]
        input_ids, attention_mask, labels = _collate(examples)
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval()
    tail = losses[-20:]
    return sum(tail) / len(tail)


# ---------------------------------------------------------------------------------------------
# Evaluation: episodes with the HF model and the environment's answers
# ---------------------------------------------------------------------------------------------
class _Episode:
    """One simulated episode: ids so far, the current turn's tokens, the consistent interval."""

    def __init__(self, ids: list[int], secret: int, k: int):
        self.ids, self.prompt_len, self.secret, self.k = list(ids), len(ids), secret, k
        self.turn: list[int] = []
        self.turns, self.reward, self.done = 0, 0.0, False
        self.lo, self.hi = 1, k
        self.invalid = self.consistent = self.valid = 0

    @property
    def response_len(self) -> int:
        return len(self.ids) - self.prompt_len


def _end_turn(ep: _Episode, tokenizer, renderer: ObservationRenderer) -> None:
    """The turn ended on eos: ask the environment, then end the episode or append the answer."""
    text = tokenizer.decode(ep.turn, skip_special_tokens=True)
    result = answer(text, ep.secret, ep.k)   # GuessEnv.step's logic, without the event loop
    ep.turns += 1
    if result.observation == task.INVALID:
        ep.invalid += 1
    else:   # a valid turn is exactly one number word
        guess = task.parse_number(text.split()[0])
        ep.valid += 1
        ep.consistent += ep.lo <= guess <= ep.hi
        ep.lo, ep.hi = narrow(ep.lo, ep.hi, guess, result.observation)
    ep.turn = []
    if result.done:
        ep.reward, ep.done = result.reward, True
        return
    if ep.turns >= MAX_TURNS:
        ep.done = True
        return
    obs = renderer.ids(result.observation, last_token=task.EOS_ID)
    if ep.response_len + len(obs) >= MAX_NEW_TOKENS:
        ep.done = True   # no room left for another guess
        return
    ep.ids += obs


@torch.no_grad()
def simulate(model, tokenizer, records: list[dict], seed: int = 0, oracle: bool = False) -> dict:
    """Temperature-1 episodes of `records` (env.max_turns = MAX_TURNS, MAX_NEW_TOKENS response
    tokens). With ``oracle`` the first token of every turn is sampled from the model's
    probabilities restricted to the consistent numbers."""
    renderer = ObservationRenderer(tokenizer)
    gen = torch.Generator().manual_seed(seed)
    eps = [_Episode(prompt_ids(tokenizer, r), r["secret"], r["k"]) for r in records]
    number_ids = torch.tensor([task.TOKEN_TO_ID[task.number_word(n)] for n in range(task.NUM_NUMBER_TOKENS)])
    while True:
        active = [e for e in eps if not e.done]
        if not active:
            break
        # equal-length groups: one forward each, no padding or position ids to get right
        by_len: dict[int, list[_Episode]] = {}
        for e in active:
            by_len.setdefault(len(e.ids), []).append(e)
        for group in by_len.values():
            logits = model(input_ids=torch.tensor([e.ids for e in group])).logits[:, -1].float()
            if oracle:
                for row, e in zip(logits, group):
                    if not e.turn:
                        allowed = number_ids[e.lo: e.hi + 1]
                        keep = torch.full_like(row, float("-inf"))
                        keep[allowed] = row[allowed]
                        row.copy_(keep)
            tokens = torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0].tolist()
            for e, tok in zip(group, tokens):
                e.ids.append(tok)
                if tok == task.EOS_ID:
                    _end_turn(e, tokenizer, renderer)
                else:
                    e.turn.append(tok)
                if not e.done and e.response_len >= MAX_NEW_TOKENS:
                    e.done = True   # the token budget ends it, unsolved
    n = len(eps)
    valid = sum(e.valid for e in eps)
    return {
        "win_rate": sum(e.reward for e in eps) / n,
        "mean_turns": sum(e.turns for e in eps) / n,
        "invalid_turn_frac": sum(e.invalid for e in eps) / max(1, sum(e.turns for e in eps)),
        "consistent_guess_frac": sum(e.consistent for e in eps) / max(1, valid),
        "mean_response_tokens": sum(e.response_len for e in eps) / n,
        "max_response_tokens": max(e.response_len for e in eps),
    }


# ---------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                   "tokenization_countdown.py", "prompts.jsonl", "eval.jsonl")


def build_args(seed: int, num_prompts: int, warmup_steps: int) -> dict:
    """The arguments that identify a build (compared by ``is_built``)."""
    return base.build_args(seed, num_prompts, warmup_steps, RECIPE_VERSION)


def build(out_dir: str, seed: int = 0, num_prompts: int = 4096, warmup_steps: int = WARMUP_STEPS,
          force: bool = False) -> dict:
    """Build (or reuse) the tiny guess model in out_dir; returns the build_info dict."""
    torch.set_num_threads(base.NUM_THREADS)
    args = build_args(seed, num_prompts, warmup_steps)
    done = base.reuse_or_clear(out_dir, args, force, _REQUIRED_FILES)
    if done is not None:
        return done
    t0 = time.perf_counter()
    info_path = os.path.join(out_dir, "build_info.json")

    tokenizer = task.build_tokenizer(out_dir)
    model = base.make_model(seed)   # same shape and special ids (guess shares countdown's)
    t_init = time.perf_counter() - t0
    final_loss = warmup(model, tokenizer, warmup_steps, seed + WARMUP_SEED_OFFSET)
    t_warm = time.perf_counter() - t0 - t_init

    model.save_pretrained(out_dir, safe_serialization=True)
    eval_records = task.make_records(NUM_EVAL, seed + EVAL_SEED_OFFSET)
    task.write_jsonl(os.path.join(out_dir, "prompts.jsonl"), task.make_records(num_prompts, seed))
    task.write_jsonl(os.path.join(out_dir, "eval.jsonl"), eval_records)
    t_build = time.perf_counter() - t0

    warm = simulate(model, tokenizer, eval_records, seed=seed)
    oracle = simulate(model, tokenizer, eval_records, seed=seed, oracle=True)
    t_total = time.perf_counter() - t0

    info = {
        "args": args,
        "model": {**base.MODEL_KWARGS, "num_params": base.num_params(model)},
        "task": {"k": K, "max_turns": MAX_TURNS, "max_new_tokens": MAX_NEW_TOKENS},
        "warmup": {"steps": warmup_steps, "batch": WARMUP_BATCH, "lr": WARMUP_LR, "p_use": P_USE,
                   "final_loss": final_loss},
        "eval": {"num": NUM_EVAL, "temperature": 1.0},
        "warm_win_rate": warm["win_rate"],
        "oracle_win_rate": oracle["win_rate"],
        "warm_eval": warm,
        "oracle_eval": oracle,
        "policy_win_rates": {   # exact, of the data policies (no model)
            "data_p_use": policy_win_rate(K, MAX_TURNS, P_USE),
            "random": policy_win_rate(K, MAX_TURNS, 0.0),
            "consistent": policy_win_rate(K, MAX_TURNS, 1.0),
            "binary_search": 1.0,
        },
        "seconds": {"init": round(t_init, 2), "warmup": round(t_warm, 2), "build": round(t_build, 2),
                    "total_with_eval": round(t_total, 2)},
    }
    with open(info_path + ".tmp", "w") as f:
        json.dump(info, f, indent=2)
    os.replace(info_path + ".tmp", info_path)
    info["skipped"] = False
    return info


def summary(info: dict, out_dir: str) -> str:
    """A few human-readable lines about a build_info dict."""
    w, o, p = info["warm_eval"], info["oracle_eval"], info["policy_win_rates"]
    verb = "reused" if info.get("skipped") else "built"
    return "\n".join([
        f"{verb} {out_dir}: Qwen2 {info['model']['num_params']:,} params, warm-up {info['warmup']['steps']} "
        f"steps at p_use {info['warmup']['p_use']} (final loss {info['warmup']['final_loss']:.3f})",
        f"  warm win rate   {w['win_rate']:.3f}  (turns {w['mean_turns']:.2f}, invalid {w['invalid_turn_frac']:.3f}, "
        f"consistent guesses {w['consistent_guess_frac']:.2f})",
        f"  oracle win rate {o['win_rate']:.3f}  (turns {o['mean_turns']:.2f}, invalid {o['invalid_turn_frac']:.3f})",
        f"  exact policies: data {p['data_p_use']:.3f}, random {p['random']:.3f}, consistent "
        f"{p['consistent']:.3f}, binary search 1.0",
        f"  seconds: {info['seconds']}",
    ])


def main(argv=None) -> dict:
    return base.run_cli(argv, build, summary, __doc__, WARMUP_STEPS)


if __name__ == "__main__":
    main()
