"""The "countdown" synthetic task: a verifiable reward with long-tailed response lengths.

Prompt ``<bos> nN =`` asks the policy to count down from N to 1::

    prompt : "<bos> n5 ="
    answer : "n5 n4 n3 n2 n1"      (N word tokens), then the model must emit <eos>

Everything here is a word-level string over a fixed 128-token vocabulary (``VOCAB``),
so prompts, answers and rewards never depend on model internals.

Length distribution (``sample_length``), a three-part mixture on 1..48:

    p=0.80  N ~ Uniform{1..6}     (short: the bulk of the work)
    p=0.15  N ~ Uniform{7..29}    (medium)
    p=0.05  N ~ Uniform{30..48}   (long tail: the stragglers partial rollout exists for)

    mean E[N] = 0.80*3.5 + 0.15*18 + 0.05*39 = 7.45   (``LENGTH_MEAN``)
    median 4 (P(N <= 3) = 0.40, P(N <= 4) = 0.53), P(N <= 6) = 0.80, max 48 (``MAX_N``).
    A full response is N + 1 tokens (answer + eos): mean 8.45, max 49.

``wrong_answer`` is the "count down by 2" mode (nN n(N-2) ... while > 0), used only by the
warm-up mixture in tools/make_tiny_model.py; it shares the first token with the correct
answer, so the policy commits to a mode at the 2nd answer token.

The module is pure Python (stdlib only); ``build_tokenizer`` imports tokenizers/transformers lazily.
"""

from __future__ import annotations

import json
import os
import random

# ---------------------------------------------------------------------------------------------
# Vocabulary
# ---------------------------------------------------------------------------------------------
PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
EQ_TOKEN = "="

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3
EQ_ID = 4

SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN]
NUM_NUMBER_TOKENS = 64  # n0 .. n63
NUMBER_OFFSET = 5  # id of "n0"
VOCAB_SIZE = 128

#: Token strings in id order: specials, "=", n0..n63, then "<unused0>".. padding up to 128.
VOCAB: list[str] = (
    SPECIAL_TOKENS
    + [EQ_TOKEN]
    + [f"n{i}" for i in range(NUM_NUMBER_TOKENS)]
    + [f"<unused{i}>" for i in range(VOCAB_SIZE - NUMBER_OFFSET - NUM_NUMBER_TOKENS)]
)
TOKEN_TO_ID: dict[str, int] = {tok: i for i, tok in enumerate(VOCAB)}
assert len(VOCAB) == VOCAB_SIZE and TOKEN_TO_ID["n0"] == NUMBER_OFFSET

# ---------------------------------------------------------------------------------------------
# Length distribution
# ---------------------------------------------------------------------------------------------
MIN_N = 1
MAX_N = 48
#: (probability, low, high) components of the length mixture; bounds inclusive.
LENGTH_MIXTURE: tuple[tuple[float, int, int], ...] = (
    (0.80, 1, 6),
    (0.15, 7, 29),
    (0.05, 30, 48),
)
LENGTH_MEAN = sum(p * (lo + hi) / 2 for p, lo, hi in LENGTH_MIXTURE)  # 7.45


def sample_length(rng: random.Random) -> int:
    """Draw N from the long-tailed mixture ``LENGTH_MIXTURE`` (values in 1..48)."""
    u = rng.random()
    acc = 0.0
    for p, lo, hi in LENGTH_MIXTURE:
        acc += p
        if u < acc:
            return rng.randint(lo, hi)
    _, lo, hi = LENGTH_MIXTURE[-1]
    return rng.randint(lo, hi)


def _check_n(n: int) -> None:
    if not (MIN_N <= n < NUM_NUMBER_TOKENS):
        raise ValueError(f"countdown n must be in [{MIN_N}, {NUM_NUMBER_TOKENS - 1}], got {n}")


def make_prompt(n: int) -> str:
    """Prompt text for N, e.g. ``"<bos> n5 ="``; it carries its own bos (the tokenizer adds none)."""
    _check_n(n)
    return f"{BOS_TOKEN} n{n} {EQ_TOKEN}"


def correct_answer(n: int) -> str:
    """Correct answer text, WITHOUT eos: ``"n5 n4 n3 n2 n1"`` (N tokens)."""
    _check_n(n)
    return " ".join(f"n{k}" for k in range(n, 0, -1))


def wrong_answer(n: int) -> str:
    """Wrong-mode answer (count down by 2), WITHOUT eos: ``"n5 n3 n1"``, ``"n6 n4 n2"``.

    For n == 1 it equals the correct answer ("n1").
    """
    _check_n(n)
    return " ".join(f"n{k}" for k in range(n, 0, -2))


def make_records(num: int, seed: int) -> list[dict]:
    """``num`` records ``{"prompt", "answer", "n"}`` with N ~ ``sample_length``; deterministic in seed."""
    rng = random.Random(seed)
    records = []
    for _ in range(num):
        n = sample_length(rng)
        records.append({"prompt": make_prompt(n), "answer": correct_answer(n), "n": n})
    return records


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
def build_tokenizer(out_dir: str | None = None):
    """Build the word-level tokenizer as a ``PreTrainedTokenizerFast``; save it to out_dir if given.

    WordLevel model over ``VOCAB``, WhitespaceSplit pre-tokenizer, no post-processor (prompts
    carry their own ``<bos>``), decoder joining tokens with single spaces. The four specials are
    registered as special tokens, so ``decode(ids, skip_special_tokens=True)`` drops pad/bos/eos/unk;
    the ``<unused*>`` tokens are ordinary words (a policy emitting them is visibly wrong).
    ``AutoTokenizer.from_pretrained(out_dir)`` reloads it, also when out_dir holds a qwen2 model
    (see ``_pin_tokenizer_class``).
    """
    # here, not at the top: transformers is heavy, and the dataset and verifier need neither
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=dict(TOKEN_TO_ID), unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # WordPiece decoder with a prefix that never occurs == "join with spaces", and it also gives
    # incremental detokenizers (vLLM) the leading space for every token after the first.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(SPECIAL_TOKENS)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=256,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    for name, tid in (("pad", PAD_ID), ("bos", BOS_ID), ("eos", EOS_ID), ("unk", UNK_ID)):
        got = getattr(hf_tok, f"{name}_token_id")
        assert got == tid, f"{name}_token_id={got}, expected {tid}"
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        hf_tok.save_pretrained(out_dir)
        _pin_tokenizer_class(out_dir)
    return hf_tok


# transformers 5 AutoTokenizer ignores tokenizer_config's class for some model types (qwen2 among
# them, see MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS) and rebuilds the tokenizer as Qwen2Tokenizer:
# byte-level BPE with the Qwen regex, which silently DROPS our "n47"-style words (no unk in BPE),
# e.g. "<bos> n47 =" -> [1, 4]. vLLM loads tokenizers through AutoTokenizer, so it is hit too.
# An ``auto_map`` entry routes around that: without trust_remote_code, AutoTokenizer then uses the
# generic TokenizersBackend on tokenizer.json; with trust_remote_code=True it imports the tiny
# module below, a TokenizersBackend subclass that also loads tokenizer.json as is.
_TOKENIZER_MODULE = "tokenization_countdown"
_TOKENIZER_CLASS = "CountdownTokenizer"
_TOKENIZER_MODULE_SOURCE = f'''"""Countdown word-level tokenizer (written by megarl.data.countdown)."""

from transformers.tokenization_utils_tokenizers import TokenizersBackend


class {_TOKENIZER_CLASS}(TokenizersBackend):
    """No custom __init__, so transformers loads tokenizer.json unchanged."""
'''


def _pin_tokenizer_class(out_dir: str) -> None:
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["auto_map"] = {"AutoTokenizer": [None, f"{_TOKENIZER_MODULE}.{_TOKENIZER_CLASS}"]}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out_dir, f"{_TOKENIZER_MODULE}.py"), "w") as f:
        f.write(_TOKENIZER_MODULE_SOURCE)


def write_jsonl(path: str, records: list[dict]) -> None:
    """Write records one JSON object per line."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def read_jsonl(path: str) -> list[dict]:
    """Read a JSON-lines file written by ``write_jsonl``."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
