"""data.prompts as a file, a glob, a list or a weighted mixture (JSONL and parquet), dotted
fields, veRL's chat rows, data.system_prompt / chat_template_kwargs, BOS, the length filter
(data.max_prompt_tokens / overlong_prompts) and the mixture's resumable stream. No model is
built: the tiny countdown tokenizer (word-level; a minimal chat template added). Seconds."""
from __future__ import annotations

import json

import pytest
from conftest import ROOT

from megarl import preflight
from megarl.config import ConfigError, load_config
from megarl.data import countdown as cd
from megarl.data.mixture import MixtureSampler, make_sampler
from megarl.data.prompts import PromptSampler, check_chat_template, encode_prompts, load_dataset, prompt_text
from megarl.data.seeds import mixture_pick_seed, mixture_source_seed
from megarl.rewards import build_verifier, needs_answer

RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"
TEMPLATE = ("{% for m in messages %}<bos> {{ m['role'] }} : {{ m['content'] }} {% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}<eos> {% endif %}"
            "{% if add_generation_prompt %}<bos> assistant :{% endif %}")


@pytest.fixture(scope="module")
def tok():
    t = cd.build_tokenizer()
    t.chat_template = TEMPLATE
    return t


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_struct_array(pa.array(rows)), path)
    return path


def verl_row(n: int) -> dict:
    """A veRL row: the prompt as chat messages, the gold answer under reward_model."""
    return {"data_source": "countdown", "prompt": [{"role": "user", "content": f"n{n} ="}],
            "ability": "count", "reward_model": {"style": "rule", "ground_truth": f"n{n}"},
            "extra_info": {"index": n}}


def text_row(n: int) -> dict:
    return {"prompt": f"<bos> n{n} =", "reward_model": {"ground_truth": f"n{n}"}}


def cfg_of(*overrides):
    return load_config(str(RECIPE), list(overrides))


@pytest.fixture()
def mixture(tmp_path):
    """A veRL parquet (12 chat rows) and a JSONL (8 text rows) as a 3:1 mixture."""
    pq = write_parquet(tmp_path / "verl.parquet", [verl_row(n) for n in range(1, 13)])
    js = write_jsonl(tmp_path / "more.jsonl", [text_row(n) for n in range(1, 9)])
    return pq, js


# ------------------------------------------------------------------------------ the acceptance
def test_verl_parquet_and_jsonl_as_a_3_to_1_mixture_feed_the_tiny_model_with_a_file_reward(tmp_path, tok, mixture):
    pq, js = mixture
    long = write_jsonl(tmp_path / "more.jsonl", [text_row(n) for n in range(1, 9)]
                       + [{"prompt": "<bos> " + "n3 " * 40 + "=", "reward_model": {"ground_truth": "n3"}}])
    verifier = tmp_path / "my_reward.py"
    verifier.write_text("from megarl.rewards import verifier\n\n@verifier(needs_answer=True, isolated=False)\n"
                        "def hit(response_text, record, *, finished, answer_key='answer'):\n"
                        "    return float(record[answer_key] in response_text)\n")
    cfg = cfg_of(f"data.prompts={{{pq}: 3, {long}: 1}}", "data.answer_key=reward_model.ground_truth",
                 "data.max_prompt_tokens=20", f"reward.fn={verifier}:hit")
    records = load_dataset(cfg.data, cfg.data.answer_key if needs_answer(cfg.reward.fn) else None)
    assert len(records) == 21 and records.weights == [3.0, 1.0] and records.source_sizes() == [12, 9]
    check_chat_template(records, cfg.model.path, cfg.data, cfg.data.messages_key, cfg.data.prompts, tok)
    preflight.check_prompts(records, tok, cfg, vocab_size=len(tok))
    assert records.dropped == 1 and records.source_sizes() == [12, 8]   # the 42-token prompt, files untouched
    assert "n3 n3 n3" in long.read_text()
    sampler = make_sampler(records, cfg.run.seed, cfg.data.shuffle)
    drawn = [records[i] for i in sampler.take(400)]
    chat = sum(isinstance(r["prompt"], list) for r in drawn)
    assert 0.75 - 0.07 < chat / 400 < 0.75 + 0.07   # binomial sd 0.022: 3 sd
    ids = encode_prompts(tok, drawn[:20], cfg.data)
    # each prompt holds its number's token (the template's role words are <unk> in the tiny vocabulary)
    assert all(tok.convert_tokens_to_ids(r["reward_model"]["ground_truth"]) in x for r, x in zip(drawn, ids))
    assert ids[[isinstance(r["prompt"], str) for r in drawn[:20]].index(True)][0] == tok.bos_token_id
    reward = build_verifier(cfg.reward.fn, timeout_s=5.0, answer_key=cfg.data.answer_key)
    rec = drawn[0]
    assert reward(f"{rec['reward_model']['ground_truth']} =", rec, finished=True) == 1.0
    assert reward.take_counts() == {"reward_errors": 0, "reward_timeouts": 0}


# --------------------------------------------------------------------------------- the sources
def test_a_file_a_glob_a_list_and_mixtures_load(tmp_path, mixture):
    pq, js = mixture
    one = load_dataset(cfg_of(f"data.prompts={js}").data)
    assert len(one) == 8 and one.weights is None and one.rows == list(range(1, 9))
    both = load_dataset(cfg_of(f"data.prompts={tmp_path}/*").data)      # sorted: more.jsonl, verl.parquet
    assert len(both) == 20 and both.weights is None and both.file_names == [str(js), str(pq)]
    assert both.where(19) == f"data.prompts={str(pq)!r}, row 12"
    listed = load_dataset(cfg_of(f"data.prompts=[{pq},{js}]").data)
    assert len(listed) == 20 and listed.source_sizes() == [20]
    assert isinstance(make_sampler(listed, 0), PromptSampler)
    entries = load_dataset(cfg_of(f"data.prompts=[{{path: {pq}, weight: 3}}, {{path: [{js}], weight: 1}}]").data)
    assert entries.weights == [3.0, 1.0] and entries.source_sizes() == [12, 8]
    assert isinstance(make_sampler(entries, 0), MixtureSampler)


def test_dotted_fields_reach_into_objects(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": {"text": "<bos> n3 ="}, "reward_model": {"ground_truth": 3}}])
    rec = load_dataset(cfg_of(f"data.prompts={path}", "data.prompt_key=q.text").data, "reward_model.ground_truth")[0]
    assert rec["q.text"] == "<bos> n3 =" and rec["reward_model.ground_truth"] == 3   # what verifiers read
    with pytest.raises(ConfigError) as e:
        load_dataset(cfg_of(f"data.prompts={path}", "data.prompt_key=q.text").data, "answer")
    msg = str(e.value)
    assert "\n" not in msg and "row 1: no field 'answer' (data.answer_key)" in msg
    assert "reward_model.ground_truth" in msg and "dotted" in msg   # the hint names the nested field


# ----------------------------------------------------------------------------- chat and format
def test_verl_chat_rows_render_with_system_prompt_and_template_options(tok, mixture):
    pq, _ = mixture
    cfg = cfg_of(f"data.prompts={pq}", "data.system_prompt=n9", "data.chat_template_kwargs={enable_thinking: false}")
    records = load_dataset(cfg.data)
    check_chat_template(records, cfg.model.path, cfg.data, cfg.data.messages_key, cfg.data.prompts, tok)
    assert prompt_text(records[0], tok, cfg.data) == "<bos> system : n9 <bos> user : n1 = <eos> <bos> assistant :"
    assert prompt_text(records[0], tok, "prompt") == "<bos> user : n1 = <bos> assistant :"   # old callers: as is
    own = {"prompt": [{"role": "system", "content": "n2"}, {"role": "user", "content": "n1"}]}
    assert prompt_text(own, tok, cfg.data).startswith("<bos> system : n2 <bos> user")   # a row's own system kept


class BosTokenizer:
    """Llama-like: encoding with special tokens puts <bos> (id 1) first."""

    def __init__(self, inner):
        self.inner, self.bos_token_id, self.chat_template = inner, 1, inner.chat_template

    def __call__(self, texts, add_special_tokens=False):
        out = self.inner(texts, add_special_tokens=False)
        if add_special_tokens:
            ids = out["input_ids"]
            out = {"input_ids": [[1, *x] for x in ids] if isinstance(texts, list) else [1, *ids]}
        return out

    def apply_chat_template(self, *args, **kwargs):
        return self.inner.apply_chat_template(*args, **kwargs)


def test_bos_as_the_tokenizer_and_the_template_say(tok):
    text, has = {"prompt": "n3 ="}, {"prompt": "<bos> n3 ="}
    chat = {"messages": [{"role": "user", "content": "n3"}]}
    llama = BosTokenizer(tok)
    assert encode_prompts(llama, [text, has], "prompt") == [[1, 8, 4], [1, 8, 4]]   # added once, never twice
    assert encode_prompts(llama, [text], "prompt", batch=True) == [[1, 8, 4]]
    assert encode_prompts(llama, [chat], "prompt")[0] == tok(prompt_text(chat, tok, "prompt"))["input_ids"]
    assert encode_prompts(tok, [text], "prompt") == [[8, 4]]   # a tokenizer that adds no BOS: none


# ---------------------------------------------------------------------------- the length filter
def test_overlong_prompts_are_dropped_and_counted_or_stop_the_run(tmp_path, tok, caplog):
    rows = [{"prompt": "<bos> " + "n3 " * k + "="} for k in (1, 12, 2, 30, 3)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = cfg_of(f"data.prompts={path}", "data.max_prompt_tokens=10")
    records = load_dataset(cfg.data)
    preflight.check_prompts(records, tok, cfg)
    assert len(records) == 3 and records.rows == [1, 3, 5] and records.dropped == 2
    assert "row 2: prompt of 14 tokens dropped" in caplog.text and "2 of 5 prompts dropped" in caplog.text
    strict = cfg_of(f"data.prompts={path}", "data.max_prompt_tokens=10", "data.overlong_prompts=error")
    with pytest.raises(ConfigError, match=r"^data\.prompts=.*, row 4: a prompt of 32 tokens exceeds "
                                          r"data\.max_prompt_tokens=10 \(2 of 5 rows do\): raise data\.max_"
                                          r"prompt_tokens to 32, or remove the long rows, or set "
                                          r"data\.overlong_prompts=drop"):
        preflight.check_prompts(load_dataset(cfg.data), tok, strict)
    with pytest.raises(ConfigError, match="every prompt of the mixture's source"):   # a source left empty
        long = write_jsonl(tmp_path / "long.jsonl", rows[3:4])
        mixed = cfg_of(f"data.prompts={{{path}: 1, {long}: 1}}", "data.max_prompt_tokens=10")
        preflight.check_prompts(load_dataset(mixed.data), tok, mixed)


# -------------------------------------------------------------------------------- the mixture stream
def test_the_mixture_draws_by_weight_and_resumes_where_it_stopped():
    sampler = MixtureSampler([50, 7], [3.0, 1.0], seed=11)
    draws = sampler.take(8000)
    share = sum(i < 50 for i in draws) / len(draws)
    assert abs(share - 0.75) < 0.02   # binomial sd 0.0048 at 8000 draws: 4 sd
    assert set(draws) == set(range(57))   # each source cycles through all its rows
    for cut in (0, 1, 37, 7999):
        a = MixtureSampler([50, 7], [3.0, 1.0], seed=11)
        a.take(cut)
        b = MixtureSampler([50, 7], [3.0, 1.0], seed=11)
        b.load_state_dict(json.loads(json.dumps(a.state_dict())))   # as a checkpoint keeps it
        assert b.take(200) == MixtureSampler([50, 7], [3.0, 1.0], seed=11).take(cut + 200)[cut:]
    assert MixtureSampler([50, 7], [3.0, 1.0], seed=12).take(50) != draws[:50]
    assert mixture_source_seed(7, 2) == 209465 and mixture_pick_seed(7, 3) == 7023795   # pinned


def test_a_checkpoint_of_another_data_stream_is_one_line():
    with pytest.raises(ConfigError, match="drawn from one file, no mixture.*mixture of 2"):
        MixtureSampler([5, 5], [1, 1], 0).load_state_dict(PromptSampler(10, 0).state_dict())
    with pytest.raises(ConfigError, match="mixture of 2 sources and data.prompts now names no mixture"):
        PromptSampler(10, 0).load_state_dict(MixtureSampler([5, 5], [1, 1], 0).state_dict())


# ------------------------------------------------------------------------------------ bad inputs
@pytest.mark.parametrize("override,must", [
    ("data.prompts=3", "data.prompts=3 names no data"),
    ("data.prompts=[]", "data.prompts=[] names no data"),
    ("data.prompts={a.jsonl: 0}", "data.prompts['a.jsonl']: weight 0 is not a number > 0"),
    ("data.prompts=[{path: a.jsonl}]", "data.prompts[0]="),
    ("data.prompts=[{path: 3, weight: 1}]", "data.prompts[0].path=3"),
    ("data.prompts=null", "data.prompts cannot be null"),
    ("data.max_prompt_tokens=-1", "data.max_prompt_tokens=-1: must be >= 0"),
    ("data.overlong_prompts=skip", "data.overlong_prompts='skip': must be one of"),
    ("rollout.sampling.top_k=0", "rollout.sampling.top_k=0: must be -1 (off) or >= 1"),
])
def test_bad_settings_are_one_line(override, must):
    with pytest.raises(ConfigError) as e:
        cfg_of(override)
    assert must in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_bad_data_at_load_is_one_line(tmp_path, tok, mixture):
    pq, js = mixture
    bad = write_jsonl(tmp_path / "b.jsonl", [{"prompt": [{"x": 1}]}])   # a chat message without role
    cases = [
        (lambda: load_dataset(cfg_of(f"data.prompts={tmp_path}/*.csv").data), "the glob"),
        (lambda: check_chat_template(load_dataset(cfg_of(f"data.prompts={js}").data), "m",
                                     cfg_of("data.system_prompt=hi").data, "messages", "x", tok),
         "data.system_prompt='hi' acts on chat rows"),
        (lambda: check_chat_template(load_dataset(cfg_of(f"data.prompts={pq}").data), "m",
                                     cfg_of("data.chat_template_kwargs={tokenize: true}").data, "messages", "x", tok),
         "data.chat_template_kwargs: 'tokenize' is set by megarl"),
        (lambda: load_dataset(cfg_of(f"data.prompts={bad}").data),
         "field 'prompt' (data.prompt_key) has message 0"),
    ]
    for call, must in cases:
        with pytest.raises((ConfigError, FileNotFoundError)) as e:
            call()
        assert must in str(e.value) and "\n" not in str(e.value), str(e.value)
