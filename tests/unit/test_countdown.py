"""Countdown task: records, length distribution, tokenizer and reward (no model, < 5 s)."""

from __future__ import annotations

import random
import statistics

import pytest

from megarl.config.registry import VERIFIERS
from megarl.data import countdown as cd
from megarl.rewards import get_reward_fn
from megarl.rewards.countdown import countdown_score


def rec(n: int) -> dict:
    return {"prompt": cd.make_prompt(n), "answer": cd.correct_answer(n), "n": n}


# ------------------------------------------------------------------------------------- records
def test_prompt_and_answers_format():
    """Prompt is "<bos> nN =", the answer counts N..1 (no eos), the wrong mode counts down by 2."""
    assert cd.make_prompt(5) == "<bos> n5 ="
    assert cd.correct_answer(5) == "n5 n4 n3 n2 n1"
    assert cd.correct_answer(1) == "n1"
    assert cd.wrong_answer(5) == "n5 n3 n1"
    assert cd.wrong_answer(6) == "n6 n4 n2"
    assert len(cd.correct_answer(48).split()) == 48
    with pytest.raises(ValueError):
        cd.make_prompt(0)


def test_make_records_deterministic_and_consistent():
    """make_records is a pure function of (num, seed) and every record is self-consistent."""
    a, b, c = cd.make_records(200, 7), cd.make_records(200, 7), cd.make_records(200, 8)
    assert a == b and a != c
    for r in a:
        assert set(r) == {"prompt", "answer", "n"}
        assert r["prompt"] == cd.make_prompt(r["n"]) and r["answer"] == cd.correct_answer(r["n"])


def test_vocab_layout():
    """Ids: <pad>=0 <bos>=1 <eos>=2 <unk>=3 "="=4, n0..n63 = 5..68, padded to 128 tokens."""
    assert cd.VOCAB[:5] == ["<pad>", "<bos>", "<eos>", "<unk>", "="]
    assert cd.TOKEN_TO_ID["n0"] == 5 and cd.TOKEN_TO_ID["n63"] == 68
    assert len(cd.VOCAB) == len(set(cd.VOCAB)) == cd.VOCAB_SIZE == 128


def test_length_distribution_is_long_tailed():
    """5000 draws (seed 0): median <= 6, max >= 30, all in 1..48, mean within 7.45 +- 0.6."""
    rng = random.Random(0)
    ns = [cd.sample_length(rng) for _ in range(5000)]
    assert min(ns) >= cd.MIN_N and max(ns) <= cd.MAX_N == 48
    assert statistics.median(ns) <= 6
    assert max(ns) >= 30
    assert cd.LENGTH_MEAN == pytest.approx(7.45)
    # sd of N is ~9.6, so the sample mean's sd is ~0.14; 0.6 is > 4 sigma.
    assert abs(statistics.mean(ns) - cd.LENGTH_MEAN) < 0.6
    assert 0.75 < sum(n <= 6 for n in ns) / len(ns) < 0.85


# ------------------------------------------------------------------------------------- reward
def test_exact_answer_with_eos_scores_one():
    """The exact answer followed by eos (finished=True) scores exactly 1.0, for every N."""
    for n in (1, 2, 5, 48):
        assert countdown_score(cd.correct_answer(n), rec(n), finished=True) == 1.0


def test_exact_answer_without_eos_is_below_one():
    """The exact answer without eos (truncated) scores N/(N+1): eos counts as the last token."""
    assert countdown_score("n5 n4 n3 n2 n1", rec(5), finished=False) == pytest.approx(5 / 6)
    assert countdown_score("n1", rec(1), finished=False) == pytest.approx(1 / 2)


def test_wrong_mode_partial_credit():
    """A count-down-by-2 answer gets prefix credit divided by the longer of target and response."""
    # N=5, target "n5 n4 n3 n2 n1 <eos>" (6 tokens), response "n5 n3 n1 <eos>" (4 tokens):
    # common prefix = 1 ("n5"), denominator = max(6, 4) = 6 -> 1/6.
    assert countdown_score(cd.wrong_answer(5), rec(5), finished=True) == pytest.approx(1 / 6)
    # N=2, target "n2 n1 <eos>" (3), response "n2 <eos>" (2): prefix 1, denominator 3 -> 1/3.
    assert countdown_score(cd.wrong_answer(2), rec(2), finished=True) == pytest.approx(1 / 3)
    # N=1: both modes are "n1", so the wrong mode is right.
    assert countdown_score(cd.wrong_answer(1), rec(1), finished=True) == 1.0


def test_overlong_answers_are_penalised():
    """Running on after the answer lowers the score through the denominator."""
    # N=5, response "n5 n4 n3 n2 n1 n0 n0 n0 <eos>" (9 tokens): prefix 5, max(6, 9) = 9 -> 5/9.
    assert countdown_score("n5 n4 n3 n2 n1 n0 n0 n0", rec(5), finished=True) == pytest.approx(5 / 9)
    # Longer junk is worse than shorter junk with the same correct prefix: 5/7 vs 5/46.
    short = countdown_score("n5 n4 n3 n2 n1 n0", rec(5), finished=True)
    long = countdown_score("n5 n4 n3 n2 n1 " + "n0 " * 40, rec(5), finished=True)
    assert short == pytest.approx(5 / 7) and long == pytest.approx(5 / 46)
    # Not stopping after the answer is never better than the truncated exact answer (5/6).
    assert countdown_score("n5 n4 n3 n2 n1 n0", rec(5), finished=False) <= 5 / 6


def test_reward_edge_cases():
    """Empty output scores 0 (or 0 when cut), whitespace is irrelevant, a literal <eos> word ends the response."""
    assert countdown_score("", rec(3), finished=True) == 0.0
    assert countdown_score("", rec(3), finished=False) == 0.0
    assert countdown_score("  n3\tn2 \n n1 ", rec(3), finished=True) == 1.0
    assert countdown_score("n3 n2 n1 <eos> n7 n7", rec(3), finished=False) == 1.0
    assert countdown_score("n4 n3 n2 n1", rec(3), finished=True) == 0.0
    for text in ("n3", "n3 n2", "n3 n1", "n9 n9 n9 n9 n9 n9 n9", "= = ="):
        for fin in (True, False):
            assert 0.0 <= countdown_score(text, rec(3), finished=fin) < 1.0


def test_reward_registry():
    """get_reward_fn returns the registered scorer; unknown names raise ValueError naming the name and known ones."""
    assert get_reward_fn("countdown") is countdown_score is VERIFIERS.get("countdown").fn
    with pytest.raises(ValueError, match="nope") as e:
        get_reward_fn("nope")
    assert "countdown" in str(e.value)


# ------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_round_trip(tmp_path):
    """Saved tokenizer reloads via AutoTokenizer; ids are the VOCAB ids; decode gives space-joined words."""
    transformers = pytest.importorskip("transformers")
    cd.build_tokenizer(str(tmp_path))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == cd.VOCAB_SIZE

    n = 12
    text = cd.make_prompt(n) + " " + cd.correct_answer(n) + " <eos>"
    ids = tok(text)["input_ids"]  # no extra bos: the prompt carries its own
    assert ids == [cd.TOKEN_TO_ID[w] for w in text.split()]
    assert ids[:3] == [1, cd.TOKEN_TO_ID["n12"], 4] and ids[-1] == 2

    answer_ids = ids[3:]
    assert tok.decode(answer_ids, skip_special_tokens=True) == cd.correct_answer(n)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert countdown_score(tok.decode(answer_ids, skip_special_tokens=True), rec(n), finished=True) == 1.0
    # Unknown words map to <unk>; unused vocabulary slots are ordinary (visible) words.
    assert tok("n64 n3")["input_ids"] == [3, cd.TOKEN_TO_ID["n3"]]
    assert tok.decode([cd.TOKEN_TO_ID["<unused0>"], 2], skip_special_tokens=True) == "<unused0>"


def test_tokenizer_survives_qwen2_model_dir(tmp_path):
    """Next to a qwen2 config.json, AutoTokenizer (any trust_remote_code) still loads our word-level tokenizer."""
    transformers = pytest.importorskip("transformers")
    transformers.Qwen2Config(vocab_size=cd.VOCAB_SIZE, hidden_size=32, num_attention_heads=2).save_pretrained(tmp_path)
    cd.build_tokenizer(str(tmp_path))
    text = "<bos> n47 ="
    for kwargs in ({}, {"trust_remote_code": False}, {"trust_remote_code": True}):
        tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), **kwargs)
        # transformers 5 would otherwise rebuild it as Qwen2Tokenizer and encode this as [1, 4].
        assert tok(text)["input_ids"] == [1, cd.TOKEN_TO_ID["n47"], 4], kwargs
        assert tok.decode([52, 50, 2], skip_special_tokens=True) == "n47 n45", kwargs
