"""The guess-the-number agent task: the environment's answers, the tokenizer and its chat
template (token-exact against the observation renderer), and the builder's exact win rates."""
import asyncio
import sys
from pathlib import Path

import pytest

from megarl.data import guess as task
from megarl.envs.base import env_spec
from megarl.envs.guess import GuessEnv, answer
from megarl.envs.render import ObservationRenderer, conversation_delta_ids

ROOT = Path(__file__).resolve().parents[2]
ID = task.TOKEN_TO_ID


def run(coro):
    return asyncio.run(coro)


def test_vocab_shares_countdown_ids_and_has_the_task_words():
    from megarl.data import countdown as cd
    assert task.VOCAB[: cd.NUMBER_OFFSET + cd.NUM_NUMBER_TOKENS] == cd.VOCAB[: cd.NUMBER_OFFSET + cd.NUM_NUMBER_TOKENS]
    assert len(task.VOCAB) == 128 and len(set(task.VOCAB)) == 128
    assert ID["n0"] == 5 and ID["n63"] == 68   # 5 + 63
    for word in ("higher", "lower", "invalid", "correct", "guess", "<user>", "<bot>"):
        assert word in ID


@pytest.mark.parametrize("turn, obs, reward, done", [
    ("n5", "lower", 0.0, False),     # secret 3 < 5
    ("n1", "higher", 0.0, False),
    ("n3", "correct", 1.0, True),
    (" n3 ", "correct", 1.0, True),  # surrounding space is no second word
    ("n9", "invalid", 0.0, False),   # out of 1..8
    ("n0", "invalid", 0.0, False),
    ("n3 n4", "invalid", 0.0, False),
    ("", "invalid", 0.0, False),
    ("higher", "invalid", 0.0, False),
    ("n03", "invalid", 0.0, False),  # not a word of the vocabulary
    ("3", "invalid", 0.0, False),
])
def test_answer(turn, obs, reward, done):
    r = answer(turn, secret=3, k=8)
    assert (r.observation, r.reward, r.done) == (obs, reward, done)


def test_env_episode_and_registration():
    env = env_spec("guess").factory(seed=7)
    assert isinstance(env, GuessEnv)
    record = {"messages": task.make_messages(8), "secret": 6, "k": 8}
    assert run(env.reset(record)) is None
    assert [run(env.step(t)).observation for t in ("n4", "n7", "n8 n1")] == ["higher", "lower", "invalid"]
    last = run(env.step("n6"))
    assert (last.reward, last.done) == (1.0, True)


def test_env_refuses_bad_records_and_options():
    with pytest.raises(ValueError, match="'secret'"):
        run(GuessEnv().reset({"secret": 9, "k": 8}))
    with pytest.raises(ValueError, match="'k'"):
        run(GuessEnv().reset({"secret": 1, "k": 64}))
    with pytest.raises(ValueError, match="env.options"):
        GuessEnv(depth=3)
    with pytest.raises(RuntimeError, match="before reset"):
        run(GuessEnv().step("n1"))


def test_make_records():
    recs = task.make_records(200, seed=1)
    assert recs == task.make_records(200, seed=1)
    assert {r["secret"] for r in recs} == set(range(1, 9))
    assert all(r["messages"] == [{"role": "user", "content": "guess n1 n8"}] and r["k"] == 8 for r in recs)
    assert "prompt" not in recs[0]   # a prompt text would win over the chat messages


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The tokenizer as a model folder holds it, reloaded by AutoTokenizer."""
    from transformers import AutoTokenizer
    out = tmp_path_factory.mktemp("guess_tok")
    task.build_tokenizer(str(out))
    assert "chat_template" in (out / "tokenizer_config.json").read_text()
    return AutoTokenizer.from_pretrained(str(out))


def test_tokenizer_round_trip(tok):
    text = "<bos> <user> guess n1 n8 <bot> n5 <eos> <user> lower <bot>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == [1, ID["<user>"], ID["guess"], 6, 13, ID["<bot>"], 10, 2, ID["<user>"], ID["lower"], ID["<bot>"]]
    assert tok.decode(ids) == text
    assert tok.decode([10, 2], skip_special_tokens=True) == "n5"   # a turn as the environment sees it
    assert tok.eos_token_id == task.EOS_ID


def test_chat_template_prompt(tok):
    text = tok.apply_chat_template(task.make_messages(8), add_generation_prompt=True, tokenize=False)
    assert text == "<bos> <user> guess n1 n8 <bot>"


def test_renderer_delta_is_user_word_bot(tok):
    r = ObservationRenderer(tok)
    assert r.template == "chat" and r.end_id == task.EOS_ID
    for word in ("higher", "lower", "invalid"):
        assert r.ids(word, last_token=task.EOS_ID) == [ID["<user>"], ID[word], ID["<bot>"]]
    # a turn cut before its eos gets the eos put back first
    assert r.ids("lower", last_token=ID["n5"]) == [task.EOS_ID, ID["<user>"], ID["lower"], ID["<bot>"]]


def test_conversation_renders_as_prompt_plus_turns_plus_deltas(tok):
    """The chat template of a whole episode, tokenized, equals what a rollout appends piece by
    piece: prompt ids, each turn's sampled ids (number, eos), each observation's delta."""
    r = ObservationRenderer(tok)
    messages = task.make_messages(8)
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    for guess, obs in (("n4", "higher"), ("n6", "lower"), ("n9", "invalid")):
        ids += [ID[guess], task.EOS_ID]
        ids += r.ids(obs, last_token=task.EOS_ID)
        messages = messages + [{"role": "assistant", "content": guess}, {"role": "user", "content": obs}]
    full = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"]
    assert ids == full
    assert len(full) == 6 + 3 * (2 + 3)
    # the conversation form of the delta agrees
    before = messages[:-1]
    delta = conversation_delta_ids(r, before, messages, last_token=task.EOS_ID)
    assert delta == [ID["<user>"], ID["invalid"], ID["<bot>"]]


@pytest.fixture(scope="module")
def builder():
    sys.path.insert(0, str(ROOT / "tools"))
    import make_tiny_agent_model
    return make_tiny_agent_model


@pytest.mark.parametrize("k, turns, p_use, expected", [
    (2, 1, 0.5, 1 / 2),             # any guess in 1..2 hits half the secrets
    (2, 2, 0.0, 1 - (1 / 2) ** 2),  # independent uniform guesses
    (2, 2, 1.0, 1.0),               # the miss leaves one number
    (3, 2, 1.0, 7 / 9),             # g=2: 1; g=1 or 3: 1/3 + 2/3 * 1/2
    (8, 4, 0.0, 1 - (7 / 8) ** 4),  # random guessing: 0.414
])
def test_policy_win_rate(builder, k, turns, p_use, expected):
    assert builder.policy_win_rate(k, turns, p_use) == pytest.approx(expected)


def test_transcript_masks_only_the_model_tokens(builder, tok):
    import random
    deltas = builder.observation_deltas(ObservationRenderer(tok))
    assert deltas["lower"] == [ID["<user>"], ID["lower"], ID["<bot>"]]
    prompt = builder.prompt_ids(tok, {"messages": task.make_messages(8)})
    ids, mask = builder.transcript(prompt, deltas, secret=5, k=8, p_use=1.0, rng=random.Random(0))
    assert len(ids) == len(mask) and ids[:6] == [1, ID["<user>"], ID["guess"], 6, 13, ID["<bot>"]]
    trained = [t for t, m in zip(ids, mask) if m]
    guesses = trained[0::2]
    assert trained[1::2] == [task.EOS_ID] * len(guesses) and 1 <= len(guesses) <= 4
    # always consistent: every guess lies in the interval the earlier answers leave
    lo, hi = 1, 8
    for g in guesses:
        n = task.parse_number(task.VOCAB[g])
        assert lo <= n <= hi
        lo, hi = (n + 1, hi) if n < 5 else (lo, n - 1)
    # no observation after the last turn: found, or cut by the 4-turn limit
    assert len(ids) == 6 + 5 * len(guesses) - 3
    assert task.VOCAB[guesses[-1]] == "n5" or len(guesses) == 4
    assert "n5" not in [task.VOCAB[g] for g in guesses[:-1]]
    assert all(m == 0 for t, m in zip(ids, mask) if t in (ID["<user>"], ID["<bot>"], ID["higher"], ID["lower"]))


def test_narrow(builder):
    assert builder.narrow(1, 8, 5, "higher") == (6, 8)
    assert builder.narrow(1, 8, 5, "lower") == (1, 4)
    assert builder.narrow(3, 6, 1, "higher") == (3, 6)   # a guess outside the interval narrows nothing
    assert builder.narrow(3, 6, 4, "invalid") == (3, 6)


class _AlwaysOne:
    """A stand-in policy: "n1" to open every turn, then eos (logits +50 on the chosen token)."""

    def __call__(self, input_ids):
        from types import SimpleNamespace

        import torch
        logits = torch.zeros(*input_ids.shape, task.VOCAB_SIZE)
        for row, last in enumerate(input_ids[:, -1].tolist()):
            logits[row, -1, task.EOS_ID if task.parse_number(task.VOCAB[last]) is not None else ID["n1"]] = 50.0
        return SimpleNamespace(logits=logits)


def test_simulate_counts_an_episode_as_the_environment_scores_it(builder, tok):
    """Always guessing n1 wins only the secret-1 episodes (1 turn); the others use all 4 turns,
    17 response tokens (4 x 2 model + 3 x 3 observation), and only their first guess is consistent."""
    records = [{"messages": task.make_messages(8), "secret": s, "k": 8} for s in (1, 2, 5, 8)]
    out = builder.simulate(_AlwaysOne(), tok, records)
    assert out["win_rate"] == 1 / 4
    assert out["mean_turns"] == (1 + 4 + 4 + 4) / 4
    assert out["invalid_turn_frac"] == 0.0
    assert out["consistent_guess_frac"] == (1 + 3 * 1) / (1 + 3 * 4)
    assert out["mean_response_tokens"] == (2 + 3 * 17) / 4 and out["max_response_tokens"] == 17
