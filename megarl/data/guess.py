"""The "guess the number" multi-turn task: the tiny agent task a tiny model learns on CPU.

A record holds a secret s in 1..K (K = ``DEFAULT_K`` = 8) and one user message naming the
range. Each model turn is one number word and the end of the turn (eos); the environment
(megarl/envs/guess.py) answers "higher", "lower", "invalid", or ends the episode on the right
number (reward 1). Rendered with the chat template below, an episode reads::

    prompt      : <bos> <user> guess n1 n8 <bot>
    model turn  : n5 <eos>
    observation : <user> lower <bot>          (the renderer's delta after a turn ending in eos)
    model turn  : n2 <eos>
    ...

Binary search wins every episode within 4 turns (ceil(log2(8 + 1)) = 4); guessing uniformly
at random, ignoring the answers, wins 1 - (7/8)^4 = 0.41 of them.

The vocabulary shares countdown's ids for the specials, "=" and n0..n63 (megarl.data.countdown),
then adds the task's words and role markers; word-level, built in code, saved with the model.
The role markers are ordinary words, not special tokens: a turn that writes one is not "one
number" once decoded, so the environment calls it invalid instead of silently dropping it.

The module is pure Python (stdlib only); ``build_tokenizer`` imports tokenizers/transformers lazily.
"""
from __future__ import annotations

import json
import os
import random

from megarl.data import countdown as cd

# ---------------------------------------------------------------------------------------------
# Vocabulary
# ---------------------------------------------------------------------------------------------
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = cd.PAD_TOKEN, cd.BOS_TOKEN, cd.EOS_TOKEN, cd.UNK_TOKEN
PAD_ID, BOS_ID, EOS_ID, UNK_ID = cd.PAD_ID, cd.BOS_ID, cd.EOS_ID, cd.UNK_ID
SPECIAL_TOKENS = list(cd.SPECIAL_TOKENS)
NUMBER_OFFSET = cd.NUMBER_OFFSET            # id of "n0", as in countdown
NUM_NUMBER_TOKENS = cd.NUM_NUMBER_TOKENS    # n0 .. n63
VOCAB_SIZE = cd.VOCAB_SIZE                  # 128: the same model shape as countdown's

USER_TOKEN, BOT_TOKEN = "<user>", "<bot>"
HIGHER, LOWER, INVALID, CORRECT, GUESS = "higher", "lower", "invalid", "correct", "guess"
TASK_WORDS = [HIGHER, LOWER, INVALID, CORRECT, GUESS, USER_TOKEN, BOT_TOKEN]

_SHARED = cd.VOCAB[: NUMBER_OFFSET + NUM_NUMBER_TOKENS]   # specials, "=", n0..n63
#: Token strings in id order: countdown's specials, "=", n0..n63, the task words, "<unused*>" up to 128.
VOCAB: list[str] = (
    _SHARED + TASK_WORDS
    + [f"<unused{i}>" for i in range(VOCAB_SIZE - len(_SHARED) - len(TASK_WORDS))]
)
TOKEN_TO_ID: dict[str, int] = {tok: i for i, tok in enumerate(VOCAB)}
assert len(VOCAB) == VOCAB_SIZE and TOKEN_TO_ID["n0"] == NUMBER_OFFSET

DEFAULT_K = 8
MAX_K = NUM_NUMBER_TOKENS - 1   # n63 is the largest number word


def number_word(n: int) -> str:
    """``5`` -> ``"n5"`` (n0..n63)."""
    if not 0 <= n < NUM_NUMBER_TOKENS:
        raise ValueError(f"number {n} has no word: the vocabulary holds n0..n{NUM_NUMBER_TOKENS - 1}")
    return f"n{n}"


def parse_number(word: str) -> int | None:
    """``"n5"`` -> 5; None for anything that is not exactly one number word."""
    if len(word) < 2 or word[0] != "n" or not word[1:].isdigit() or word not in TOKEN_TO_ID:
        return None
    return int(word[1:])


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------
def make_messages(k: int = DEFAULT_K) -> list[dict]:
    """The episode's opening chat: one user message naming the range, ``"guess n1 n8"``."""
    if not 2 <= k <= MAX_K:
        raise ValueError(f"guess k={k}: use 2..{MAX_K} (the vocabulary's numbers end at n{MAX_K})")
    return [{"role": "user", "content": f"{GUESS} {number_word(1)} {number_word(k)}"}]


def make_records(num: int, seed: int, k: int = DEFAULT_K) -> list[dict]:
    """``num`` records ``{"messages", "secret", "k"}`` with secret ~ Uniform{1..k}; deterministic in seed.

    No "prompt" field: a text prompt would win over the messages (megarl.data.prompts), and the
    chat path is what the agent episodes exercise."""
    rng = random.Random(seed)
    messages = make_messages(k)
    return [{"messages": [dict(m) for m in messages], "secret": rng.randint(1, k), "k": k} for _ in range(num)]


# ---------------------------------------------------------------------------------------------
# Tokenizer and chat template
# ---------------------------------------------------------------------------------------------
#: The conversation opens with <bos>; a user (or any non-assistant) message adds " <user> {content}",
#: an assistant one " <bot> {content} <eos>", the generation prompt " <bot>" (the assistant's header).
#: Every token is space-separated and nothing follows <eos>, so a rendered conversation tokenizes
#: exactly as prompt ids + model ids + the renderer's deltas ([<user>, word, <bot>]).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    " " + BOT_TOKEN + " {{ message['content'] }} {{ eos_token }}"
    "{% else %}"
    " " + USER_TOKEN + " {{ message['content'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %} " + BOT_TOKEN + "{% endif %}"
)


def build_tokenizer(out_dir: str | None = None):
    """The word-level tokenizer (countdown's recipe over ``VOCAB``) with ``CHAT_TEMPLATE``; saved
    to out_dir if given, loadable there by ``AutoTokenizer.from_pretrained`` (countdown's
    ``auto_map`` pin) with the template in tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=dict(TOKEN_TO_ID), unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # join with spaces (countdown's note)
    tok.add_special_tokens(SPECIAL_TOKENS)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN, model_max_length=256, padding_side="left", clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        hf_tok.save_pretrained(out_dir)
        cd._pin_tokenizer_class(out_dir)
        _template_into_config(out_dir)
    return hf_tok


def _template_into_config(out_dir: str) -> None:
    """Keep the chat template in tokenizer_config.json (transformers 5 writes it to a separate
    chat_template.jinja, which older loaders and the model-export copy rules may not read)."""
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = CHAT_TEMPLATE
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    jinja = os.path.join(out_dir, "chat_template.jinja")
    if os.path.exists(jinja):
        os.remove(jinja)   # one copy of the template: the .jinja file would win when both exist


write_jsonl = cd.write_jsonl
read_jsonl = cd.read_jsonl
